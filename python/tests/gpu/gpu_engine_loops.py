#!/usr/bin/env python3
"""The engine loops of python/bench/_engine_loops.py with framework "pt":
real torch and the real safetensors.safe_open / load_file, parameters on
the GPU. Writes a two-shard Llama-shaped checkpoint, loads it for every
rank of tp 1, 2 and 4 with each loop, and checks that the ranks' parts put
together are the checkpoint's tensors.

    PYTHONPATH=python/bench python3 python/tests/gpu/gpu_engine_loops.py
"""

import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import _engine_loops as loops

H, I, V = 64, 128, 256


def main():
    g = torch.Generator().manual_seed(26)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    shards = [
        {"model.embed_tokens.weight": r(V, H), "model.layers.0.input_layernorm.weight": r(H),
         "model.layers.0.self_attn.q_proj.weight": r(H, H), "model.layers.0.self_attn.k_proj.weight": r(H, H),
         "model.layers.0.self_attn.v_proj.weight": r(H, H), "model.layers.0.self_attn.o_proj.weight": r(H, H)},
        {"model.layers.0.mlp.gate_proj.weight": r(I, H), "model.layers.0.mlp.up_proj.weight": r(I, H),
         "model.layers.0.mlp.down_proj.weight": r(H, I), "model.norm.weight": r(H), "lm_head.weight": r(V, H)},
    ]
    full = {k: v for s in shards for k, v in s.items()}
    with tempfile.TemporaryDirectory() as d:
        files = []
        for i, s in enumerate(shards):
            p = str(Path(d) / f"model-{i + 1:05d}-of-00002.safetensors")
            save_file(s, p, metadata={"format": "pt"})
            files.append(p)

        names = [n for n, _ in loops.vllm_iterate(safe_open, files)]
        # keys() comes sorted within a file (safetensors 0.8), shard after shard
        assert names == [n for s in shards for n in sorted(s)], names
        devs = {t.device.type for _, t in loops.vllm_iterate(safe_open, files)}
        assert devs == {"cpu"}, devs  # no device=: vLLM's tensors come to the CPU
        devs = {str(t.device) for _, t in loops.vllm_fastsafetensors_emulated(safe_open, files)}
        assert devs == {"cuda:0"}, devs

        for name, run in [
            ("vllm", lambda p, rank, tp: loops.load_into(p, files, rank, tp, safe_open=safe_open)),
            ("sglang", lambda p, rank, tp: loops.sglang_load_into(p, files, rank, tp, safe_open=safe_open)),
            ("sglang_sharded", lambda p, rank, tp: loops.sglang_load_into(
                p, files, rank, tp, safe_open=safe_open, is_all_weights_sharded=True, load_file=load_file)),
            ("get_slice", lambda p, rank, tp: loops.load_into_get_slice(p, files, rank, tp, safe_open=safe_open)),
        ]:
            for tp in (1, 2, 4):
                ranks = []
                for rank in range(tp):
                    params = {}
                    for k, v in full.items():
                        shape = list(v.shape)
                        dim = loops.llama_shard_dim(k)
                        if dim is not None:
                            shape[dim] //= tp
                        params[k] = torch.nn.Parameter(
                            torch.full(shape, float("nan"), dtype=v.dtype, device="cuda"), requires_grad=False)
                    assert run(params, rank, tp) == set(full)
                    ranks.append(params)
                for k, v in full.items():
                    dim = loops.llama_shard_dim(k)
                    got = ranks[0][k] if dim is None else torch.cat([p[k] for p in ranks], dim=dim)
                    assert torch.equal(got.cpu(), v), (name, tp, k)
            print(f"{name}: tp 1, 2, 4 equal to the checkpoint")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
