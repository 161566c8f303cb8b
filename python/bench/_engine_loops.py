"""The weight-loading loops of vLLM and SGLang, re-implemented minimally so
that the GPU tests and benchmarks can run them against any object with the
safetensors API: the real ``safetensors.safe_open`` or
``gpushm.safetensors.safe_open``, passed in as a parameter.

Each loop keeps exactly the calls the engine makes (which function opens the
file, with which ``framework=`` and ``device=``, whether it reads whole
tensors with ``get_tensor`` or parts with ``get_slice``) and drops what does
not touch the file (progress bars, logging, name remapping). Written from
their source, read (not run) at these commits:

vLLM (vllm-project/vllm):
  vllm/model_executor/model_loader/weight_utils.py at 0a1ee72ed53f
    ``safetensors_weights_iterator``: for every shard file,
    ``safe_open(st_file, framework="pt")`` (no ``device=``, so tensors come
    back on the CPU), then ``f.get_tensor(name)`` for every ``f.keys()``.
    No ``get_slice``. ``safe_open`` is imported as
    ``from safetensors.torch import load_file, safe_open, save_file``.
    ``fastsafetensors_weights_iterator``: does not use ``safe_open``; the
    fastsafetensors library copies whole files to ``cuda:{pg.rank()}`` (one
    file per rank of the process group) and yields tensors already on that
    GPU.
  vllm/model_executor/model_loader/default_loader.py at 0e06f49835a6
    ``DefaultModelLoader.load_weights``: ``model.load_weights(iterator)``;
    each parameter's ``weight_loader`` puts the tensor in place.
  vllm/model_executor/layers/linear.py at 9e109c9887e3
    ``ColumnParallelLinear.weight_loader``: ``shard_size =
    param.data.shape[output_dim]``, ``loaded_weight =
    loaded_weight.narrow(output_dim, tp_rank * shard_size, shard_size)``,
    ``param.data.copy_(loaded_weight)``; ``RowParallelLinear`` does the same
    on ``input_dim``. weight_utils.py's ``default_weight_loader`` copies a
    replicated tensor whole (``fill_`` when both are one element).

SGLang (sgl-project/sglang):
  python/sglang/srt/model_loader/weight_utils.py at 57003beaaa7b
    ``safetensors_weights_iterator(hf_weights_files,
    is_all_weights_sharded=False)``: ``safe_open(st_file, framework="pt")``
    and ``get_tensor`` as vLLM; with ``is_all_weights_sharded``,
    ``load_file(st_file, device="cpu")`` for the whole file. No
    ``get_slice``.
  python/sglang/srt/layers/linear.py at 98b3b24a0f06
    the ``weight_loader`` methods narrow the full tensor as vLLM's do
    (``loaded_weight.narrow(output_dim, tp_rank * shard_size, shard_size)``)
    and ``param_data.copy_(loaded_weight)``.

Neither engine uses ``get_slice`` in these paths: every rank reads every
whole tensor and narrows it. ``load_into_get_slice`` below is the variant
that reads only the rank's part; it is a reference for comparison, not
either engine's loop.

torch is imported only inside the functions that need it. Every loop takes
``framework``: with ``"pt"`` it uses torch (``narrow``, ``copy_``), with
``"np"`` numpy slicing (``a[..., start:start+size, ...]``, ``np.copyto``), so
that a CPU test without torch runs the same code paths.
"""

from __future__ import annotations

import re

__all__ = [
    "vllm_iterate",
    "vllm_fastsafetensors_device",
    "vllm_fastsafetensors_emulated",
    "sglang_iterate",
    "llama_shard_dim",
    "load_into",
    "sglang_load_into",
    "load_into_get_slice",
    "as_engine",
]

# The module each engine's loop lives in (the files cited above).
ENGINE_MODULES = {
    "vllm": "vllm.model_executor.model_loader.weight_utils",
    "sglang": "sglang.srt.model_loader.weight_utils",
}


def as_engine(engine):
    """This file loaded again as the module the engine's loop lives in
    (ENGINE_MODULES), under that name in sys.modules with empty parent
    packages: code that finds its caller by module name (gpushm's
    cpu_tensors="auto") then sees these loops as it would see the engine's.
    Only for processes that do not have the engine installed."""
    import importlib.util
    import sys
    import types

    name = ENGINE_MODULES[engine]
    got = sys.modules.get(name)
    if got is not None:
        if getattr(got, "__file__", None) != __file__:
            raise RuntimeError(f"{name} is the engine's own module ({got.__file__}), not a stand-in")
        return got
    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = []
            sys.modules[pkg] = mod
    spec = importlib.util.spec_from_file_location(name, __file__)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------- iterators


def vllm_iterate(safe_open, files, framework="pt"):
    """vLLM's ``safetensors_weights_iterator`` (default, "lazy" strategy):
    yields ``(name, tensor)`` for every tensor of every file, in file order
    and then in ``f.keys()`` order.

    The call is ``safe_open(st_file, framework="pt")`` without ``device=``;
    ``framework`` is a parameter here only so that a test can pass "np"."""
    for st_file in files:
        with safe_open(st_file, framework=framework) as f:
            for name in f.keys():  # noqa: SIM118 (as the engine writes it)
                param = f.get_tensor(name)
                yield name, param


def vllm_fastsafetensors_device(rank=0):
    """The device vLLM's ``fastsafetensors_weights_iterator`` yields on:
    ``torch.device(f"cuda:{pg.rank()}")``, where ``pg`` is the world process
    group (``SingleGroup()``, rank 0, when torch.distributed is not
    initialised)."""
    return f"cuda:{rank}"


def vllm_fastsafetensors_emulated(safe_open, files, rank=0, world_size=1, framework="pt"):
    """An emulation, through the safetensors API, of where vLLM's
    ``fastsafetensors_weights_iterator`` puts tensors: the files are taken
    in groups of ``world_size`` (``hf_weights_files[i : i + pg.size()]``) and
    every tensor is yielded already on ``cuda:{rank}``.

    Not the same calls: the real iterator never calls ``safe_open``; each
    rank's ``SafeTensorsFileLoader`` reads one file of the group to its GPU
    (GPUDirect Storage, or ``nogds=True``) and ``fb.get_tensor(k)`` shares
    the group's tensors between ranks. Here this rank opens every file with
    ``device=`` its GPU, which is what a gpushm bundle gives without a
    copy. With ``framework="np"`` the device is "cpu"."""
    device = vllm_fastsafetensors_device(rank) if framework == "pt" else "cpu"
    groups = [files[i : i + world_size] for i in range(0, len(files), world_size)]
    for group in groups:
        for st_file in group:
            with safe_open(st_file, framework=framework, device=device) as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)


def sglang_iterate(safe_open, files, framework="pt", is_all_weights_sharded=False, load_file=None):
    """SGLang's ``safetensors_weights_iterator``: ``safe_open(st_file,
    framework="pt")`` and ``get_tensor`` for every key; with
    ``is_all_weights_sharded``, ``load_file(st_file, device="cpu")`` reads
    each whole file at once (pass the matching ``load_file``:
    ``safetensors.torch.load_file`` or gpushm's)."""
    for st_file in files:
        if not is_all_weights_sharded:
            with safe_open(st_file, framework=framework) as f:
                for name in f.keys():  # noqa: SIM118
                    param = f.get_tensor(name)
                    yield name, param
        else:
            if load_file is None:
                raise ValueError("is_all_weights_sharded needs load_file")
            result = load_file(st_file, device="cpu")
            for name, param in result.items():
                yield name, param


# ------------------------------------------------------- tensor-parallel load

_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def llama_shard_dim(name):
    """Which dimension a Llama-layout checkpoint tensor is split on under
    tensor parallelism in vLLM and SGLang, or None when every rank holds it
    whole: q/k/v/gate/up projections are column-parallel (output dim 0), o
    and down projections row-parallel (input dim 1, their biases are not
    split), the embedding and LM head vocab-parallel (dim 0), norms
    replicated.

    (The engines fuse q/k/v into one qkv_proj and gate/up into gate_up_proj;
    that changes where in the parameter the rank's shard lands, not what is
    read from the checkpoint, which is the part loaded here. For k/v with
    fewer KV heads than ranks they replicate heads instead; the benchmarks
    use shapes where that does not arise.)"""
    if _COLUMN.search(name) or _VOCAB.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def _ops(framework):
    """(narrow, copy_into) for the framework."""
    if framework == "pt":

        def narrow(t, dim, start, size):
            return t.narrow(dim, start, size)

        def copy_into(param, src):
            data = getattr(param, "data", param)
            if data.numel() == 1 and src.numel() == 1:
                data.fill_(src.item())
            else:
                data.copy_(src)

    elif framework == "np":
        import numpy as np

        def narrow(a, dim, start, size):
            index = (slice(None),) * dim + (slice(start, start + size),)
            return a[index]

        def copy_into(param, src):
            if param.size == 1 and src.size == 1:
                param.fill(src.reshape(()).item())
            else:
                np.copyto(param, src, casting="no")

    else:
        raise ValueError(f"framework {framework!r}: expected 'pt' or 'np'")
    return narrow, copy_into


def _shape(t):
    return tuple(t.shape)


def load_into(params, files, tp_rank, tp_size, *, safe_open, framework="pt",
              shard_dim=llama_shard_dim, iterate=None):
    """vLLM's default loader with column/row-parallel ``weight_loader``s:
    every ``(name, full_tensor)`` from the engine's iterator (``iterate``,
    vLLM's by default) is narrowed on its shard dimension to this rank's
    part, ``full.narrow(dim, tp_rank * shard_size, shard_size)`` with
    ``shard_size = param.shape[dim]``, and copied with
    ``param.data.copy_(shard)`` into the engine's own preallocated
    parameter, ``params[name]``. Tensors with no parameter are skipped, as
    a model skips names it does not know.

    Returns the set of names loaded (what ``model.load_weights`` returns).
    ``tp_size`` is not used by the engines' ``weight_loader`` (the
    parameter's shape carries it); here it checks that the parameter is one
    of ``tp_size`` equal parts."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
    narrow, copy_into = _ops(framework)
    iterate = iterate or vllm_iterate
    loaded = set()
    for name, loaded_weight in iterate(safe_open, files, framework=framework):
        param = params.get(name)
        if param is None:
            continue
        dim = shard_dim(name)
        if dim is not None and dim < len(_shape(loaded_weight)):
            shard_size = _shard_size(name, param, _shape(loaded_weight), dim, tp_size)
            loaded_weight = narrow(loaded_weight, dim, tp_rank * shard_size, shard_size)
        _copy_checked(copy_into, name, param, loaded_weight)
        loaded.add(name)
    return loaded


def _numel(t):
    n = 1
    for s in t.shape:
        n *= s
    return n


def _shard_size(name, param, full_shape, dim, tp_size):
    """param's length on dim, checked to be 1/tp_size of the full tensor's
    (full_shape)."""
    shard_size = _shape(param)[dim]
    if shard_size * tp_size != full_shape[dim]:
        raise ValueError(
            f"{name}: parameter {_shape(param)} is not 1/{tp_size} of "
            f"{full_shape} on dim {dim}"
        )
    return shard_size


def _copy_checked(copy_into, name, param, part):
    """copy_into(param, part), once part has param's shape (or both hold
    one element)."""
    if _shape(param) != _shape(part) and not (
        _numel(param) == 1 and _numel(part) == 1
    ):
        raise ValueError(f"{name}: loading {_shape(part)} into {_shape(param)}")
    copy_into(param, part)


def sglang_load_into(params, files, tp_rank, tp_size, *, safe_open, framework="pt",
                     shard_dim=llama_shard_dim, is_all_weights_sharded=False, load_file=None):
    """SGLang's default loader: its iterator, then the same narrow-and-copy
    ``weight_loader`` as vLLM's (SGLang's linear.py narrows the full tensor
    the same way)."""

    def iterate(safe_open, files, framework):
        return sglang_iterate(safe_open, files, framework=framework,
                              is_all_weights_sharded=is_all_weights_sharded,
                              load_file=load_file)

    return load_into(params, files, tp_rank, tp_size, safe_open=safe_open,
                     framework=framework, shard_dim=shard_dim, iterate=iterate)


def load_into_get_slice(params, files, tp_rank, tp_size, *, safe_open, framework="pt",
                        shard_dim=llama_shard_dim):
    """Not an engine's loop: the same result as ``load_into``, reading only
    this rank's part of each split tensor with ``f.get_slice(name)[...]``
    instead of the whole tensor with ``get_tensor``. Neither vLLM nor SGLang
    does this at the commits read; it is here for comparison."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
    _, copy_into = _ops(framework)
    loaded = set()
    for st_file in files:
        with safe_open(st_file, framework=framework) as f:
            for name in f.keys():  # noqa: SIM118
                param = params.get(name)
                if param is None:
                    continue
                dim = shard_dim(name)
                sl = f.get_slice(name)
                full_shape = tuple(sl.get_shape())
                if dim is None or dim >= len(full_shape):
                    part = sl[:] if full_shape else f.get_tensor(name)
                else:
                    shard_size = _shard_size(name, param, full_shape, dim, tp_size)
                    start = tp_rank * shard_size
                    index = (slice(None),) * dim + (slice(start, start + shard_size),)
                    part = sl[index]
                _copy_checked(copy_into, name, param, part)
                loaded.add(name)
    return loaded
