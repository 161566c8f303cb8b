"""What the benchmarks print: one PASS, FAIL, SKIP or INFO line per check,
kept for the summary and the exit status, and markdown tables."""

verdicts = []


def say(kind, name, detail):
    line = f"{kind} {name}: {detail}"
    print(line, flush=True)
    verdicts.append(line)


def check(ok, name, detail):
    say("PASS" if ok else "FAIL", name, detail)
    return ok


def table(title, header, rows):
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    print(flush=True)
