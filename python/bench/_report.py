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


def leftovers(started, socket, backend, used0, used_now):
    """What every benchmark ends with, once its daemon is stopped: the
    processes it started still alive (none), and on cuda the GPU memory in
    use (used_now(), MiB per GPU, None when unknown) against used0, what
    it found at its start."""
    from gpushm import testing

    alive = testing.still_alive(started, naming=socket)
    check(not alive, "leftover-processes", "processes this run started, still alive: " + ("; ".join(alive) or "none"))
    if backend != "cuda":
        say("INFO", "leftover-gpu-memory", "host backend: no GPU memory to check")
        return
    used = used_now()
    if used is None or used0 is None:
        say("INFO", "leftover-gpu-memory", "nothing here could say how much GPU memory is in use: not checked")
    else:
        check(all(u <= u0 + 64 for u, u0 in zip(used, used0)), "leftover-gpu-memory",
              f"GPU memory in use at the end {used} MiB, at the start {used0} MiB")
