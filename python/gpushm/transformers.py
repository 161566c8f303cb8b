"""Hugging Face transformers models whose weights live in a gpushm bundle.

    import gpushm.transformers
    model = gpushm.transformers.from_pretrained("llama")   # no weight copied
    out = model.generate(input_ids.to(model.device), max_new_tokens=20)

The bundle is what 'gpushm put llama DIR' made of a checkpoint directory:
the tensors of every shard, and the small files (config.json,
generation_config.json, the tokenizer's). A worker reads nothing from disk:
the config comes from the bundle, the model is built with its parameters on
the meta device (no memory, no initialisation), and the bundle's tensors
become its parameters where they lie. transformers is imported only when a
function here is called.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import time
import warnings

from .safetensors import written_after_load

# Files written to a private temporary directory for transformers to read:
# configs, and the Python files of models that need trust_remote_code.
_CONFIG_FILES = ("config.json", "generation_config.json")

# Benchmarks set this to a list to learn where from_pretrained's time goes:
# each call appends (step, seconds) for each of its steps.
_steps = None


def from_pretrained(name: str, *, client=None, readonly: bool = True, model_class=None, strict: bool = True,
                    **kwargs):
    """Builds the model that bundle name holds, on its GPU, sharing its
    weights with every other process that does the same.

    model_class defaults to transformers.AutoModelForCausalLM (any class with
    from_config works). kwargs are as for transformers' from_pretrained:
    trust_remote_code and attn_implementation go to the model, anything
    else updates the config. torch_dtype/dtype and device_map/device are
    accepted only when they ask for what the bundle already is ("auto", or
    the stored dtype and the segment's GPU): anything else would need a
    copy of the weights.

    The model is built with no weight initialisation at all: every
    parameter is on the meta device from the moment it is registered, and
    transformers' own switch (no_init_weights) skips the initialisers. The
    parameters then are the bundle's tensors (gpushm.torch.state_dict), with
    requires_grad off; tied weights are tied again after assignment
    (model.tie_weights()); buffers the checkpoint does not hold (rotary
    inv_freq, ...) are made by the model's own constructor and moved to the
    GPU. With strict, a parameter or buffer that neither the checkpoint nor
    the constructor provides is an error naming it.

    With readonly (the default) the mapping is read-only and the weights
    are inference tensors: an in-place update outside torch.inference_mode()
    raises RuntimeError; its kernel, like any write by a kernel, faults on
    the read-only mapping and loses this process's CUDA context, never
    another process's weights (docs/python.md, "Writes to shared weights")."""
    import torch
    import transformers

    from . import torch as gtorch

    step = _Steps(_steps)
    c = gtorch._client(client)
    # One open serves the tensors and the files: the bundle stays mapped.
    bundle = c.tensors(name, readonly=readonly)
    files = bundle.files(lambda n: n in _CONFIG_FILES or n.endswith(".py"))
    if "config.json" not in files:
        raise ValueError(f"gpushm: bundle {name!r} has no config.json; put the checkpoint directory "
                         "('gpushm put NAME DIR'), not a single file")
    step("open the bundle, read its config files")
    sd = gtorch._torch_tensors(bundle, readonly)
    if not sd:
        raise ValueError(f"gpushm: bundle {name!r} holds no tensors")
    step("torch tensors of the bundle")
    dtype, device = _stored(sd)
    _check_dtype(name, kwargs, dtype)
    _check_device(name, kwargs, device)
    model_kwargs = {k: kwargs.pop(k) for k in ("trust_remote_code", "attn_implementation") if k in kwargs}
    with tempfile.TemporaryDirectory(prefix="gpushm-config-") as tmp:
        _write(tmp, files, lambda n: True)
        config = transformers.AutoConfig.from_pretrained(
            tmp, trust_remote_code=model_kwargs.get("trust_remote_code", False), **kwargs)
        generation = None
        if "generation_config.json" in files:
            generation = transformers.GenerationConfig.from_pretrained(tmp)
        step("config")
        cls = model_class or transformers.AutoModelForCausalLM
        # Parameters on meta as they are registered, no initialiser run;
        # buffers where the constructor makes them, in the checkpoint's
        # dtype as transformers' own loader makes them.
        with _on_cpu(torch), _default_dtype(torch, dtype), _parameters_on_meta(torch), _no_init_weights():
            if hasattr(cls, "from_config"):
                model = cls.from_config(config, **model_kwargs)
            else:
                model = cls(config, **model_kwargs)
    step("build the model on meta, without initialisation")
    slots, modules = _slots(model)
    for mod, kind, local, _, _ in slots:
        t = getattr(mod, kind)[local]
        if t is None:
            continue
        if kind == "_parameters":
            t.requires_grad_(False)
        elif not t.is_meta and t.device != device:
            mod._buffers[local] = t.to(device)
    _make_meta_buffers(model, device)
    sd = _match_prefix(model, {full for _, _, _, full, persistent in slots if persistent}, sd)
    # Inside inference mode the parameters made of inference tensors are
    # inference tensors too; outside it torch refuses to wrap them.
    with torch.inference_mode() if readonly else torch.no_grad():
        unexpected, how = _assign(torch, model, modules, slots, sd)
        step(f"assign the tensors ({how})")
        model.tie_weights()
        step("tie weights")
    if unexpected:
        warnings.warn(f"gpushm: bundle {name!r} holds tensors the model does not use: "
                      f"{_some(unexpected)}", RuntimeWarning, stacklevel=2)
    missing = [full for mod, kind, local, full, _ in slots
               if getattr(mod, kind)[local] is not None and getattr(mod, kind)[local].is_meta]
    if missing and strict:
        raise ValueError(f"gpushm: bundle {name!r} lacks {len(missing)} of the model's tensors: {_some(missing)} "
                         f"(names must match what {type(model).__name__}.save_pretrained writes)")
    try:  # not the temporary directory the config was read from
        model.config.name_or_path = name
    except AttributeError:
        pass
    if generation is not None:
        model.generation_config = generation
    model.eval()
    step("finish")
    return model


class _Steps:
    """Records how long each step took into a list, when given one."""

    def __init__(self, sink):
        self.sink, self.t = sink, time.perf_counter()

    def __call__(self, what):
        if self.sink is not None:
            now = time.perf_counter()
            self.sink.append((what, now - self.t))
            self.t = now


def _slots(model):
    """Every parameter and buffer slot of the model, tied ones included:
    [(module, "_parameters" or "_buffers", name in the module, full name,
    whether a checkpoint holds it)], and the modules. One walk, where
    load_state_dict and state_dict would each make their own."""
    slots, modules = [], []
    for prefix, mod in model.named_modules():
        modules.append(mod)
        p = prefix + "." if prefix else ""
        for local in mod._parameters:
            slots.append((mod, "_parameters", local, p + local, True))
        for local in mod._buffers:
            slots.append((mod, "_buffers", local, p + local, local not in mod._non_persistent_buffers_set))
    return slots, modules


def _assign(torch, model, modules, slots, sd):
    """Makes the checkpoint's tensors the model's parameters and buffers
    where they lie, as load_state_dict(sd, strict=False, assign=True) does,
    in one pass over the slots instead of its walk of every module with its
    checks per key. Returns (the checkpoint names the model has no slot
    for, how they were assigned). A model that loads state dicts its own
    way (its own load_state_dict, a module's own _load_from_state_dict, or
    hooks) goes through load_state_dict itself."""
    Module = torch.nn.Module
    if type(model).load_state_dict is not Module.load_state_dict or any(
            type(m)._load_from_state_dict is not Module._load_from_state_dict
            or getattr(m, "_load_state_dict_pre_hooks", None) or getattr(m, "_load_state_dict_post_hooks", None)
            for m in modules):
        return list(model.load_state_dict(sd, strict=False, assign=True).unexpected_keys), "load_state_dict"
    Parameter = torch.nn.Parameter
    used, wrong = set(), []
    for mod, kind, local, full, persistent in slots:
        t = sd.get(full) if persistent else None
        cur = getattr(mod, kind)[local]
        if t is None or cur is None:  # an absent bias, say: the name stays unexpected, as for torch
            continue
        used.add(full)
        if cur.shape != t.shape:
            wrong.append(f"{full}: checkpoint {tuple(t.shape)}, model {tuple(cur.shape)}")
            continue
        # Buffers (running statistics, masks, anything that is not a
        # parameter) and parameters loaders are known to write after loading
        # (quantization scales) get a private copy: the shared memory is
        # mapped read-only, and a write there would end this process.
        if kind == "_parameters":
            mod._parameters[local] = Parameter(t.clone() if written_after_load(full) else t, requires_grad=False)
        else:
            mod._buffers[local] = t.clone()
    if wrong:
        raise RuntimeError(f"gpushm: the checkpoint's shapes do not match {type(model).__name__}'s: {_some(wrong)}")
    return [k for k in sd if k not in used], "slot by slot"


def tokenizer(name: str, *, client=None, **kwargs):
    """transformers.AutoTokenizer for the tokenizer files bundle name keeps;
    they are written to a private temporary directory for the tokenizer to
    read, and removed."""
    import transformers

    from . import torch as gtorch

    files = gtorch._client(client).files(name)
    with tempfile.TemporaryDirectory(prefix="gpushm-tokenizer-") as tmp:
        _write(tmp, files, lambda n: True)
        return transformers.AutoTokenizer.from_pretrained(tmp, **kwargs)


def _write(dir, files, want):
    for n, data in files.items():
        if want(n):
            with open(os.path.join(dir, n), "wb") as f:
                f.write(data)


def _stored(sd):
    """The checkpoint's floating dtype (the one holding most bytes) and
    device."""
    by = collections.Counter()
    for t in sd.values():
        if t.is_floating_point():
            by[t.dtype] += t.numel() * t.element_size()
    dtype = by.most_common(1)[0][0] if by else None
    return dtype, next(iter(sd.values())).device


def _check_dtype(name, kwargs, dtype):
    import torch

    for key in ("torch_dtype", "dtype"):
        want = kwargs.pop(key, None)
        if want is None or want == "auto":
            continue
        if isinstance(want, str):
            want = getattr(torch, want, want)
        if want != dtype:
            raise ValueError(f"gpushm: bundle {name!r} holds {dtype}; {key}={want} would need a copy of the weights "
                             "(convert the checkpoint and put it again, or leave the dtype out)")


def _check_device(name, kwargs, device):
    import torch

    for key in ("device_map", "device"):
        want = kwargs.pop(key, None)
        if want is None or want == "auto":
            continue
        try:
            d = torch.device(want) if not isinstance(want, int) else torch.device("cuda", want)
        except (TypeError, RuntimeError):
            d = None
        if d is not None and d.type == device.type and (d.index is None or d.index == device.index):
            continue
        raise ValueError(f"gpushm: bundle {name!r} lives on {device}; {key}={want!r} would need a copy of the weights")


def _make_meta_buffers(model, device):
    """Rotary embeddings whose inv_freq a transformers version left on the
    meta device are computed again the way their constructor does."""
    for mod in model.modules():
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            init, config = getattr(mod, "rope_init_fn", None), getattr(mod, "config", None)
            if init is not None and config is not None and "inv_freq" in mod._buffers:
                inv_freq, scaling = init(config, device)
                mod._buffers["inv_freq"] = inv_freq
                if hasattr(mod, "original_inv_freq"):
                    mod.original_inv_freq = inv_freq
                if hasattr(mod, "attention_scaling"):
                    mod.attention_scaling = scaling


def _match_prefix(model, want, sd):
    """Renames checkpoint keys saved from the base model (without, say,
    "model.") or from a head model (with it), as transformers' loader does.
    want: the model's own names."""
    if want & sd.keys():
        return sd
    prefix = getattr(model, "base_model_prefix", "") + "."
    if prefix != "." and {prefix + k for k in sd} & want:
        return {prefix + k: v for k, v in sd.items()}
    if prefix != "." and {k[len(prefix):] for k in sd if k.startswith(prefix)} & want:
        return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
    return sd


def _some(names, n=8):
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


@contextlib.contextmanager
def _default_dtype(torch, dtype):
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _no_init_weights():
    """transformers' own switch that skips weight initialisation: the
    torch.nn.init functions and the model's init_weights (which also ties
    weights; from_pretrained ties them after assignment). Every parameter
    becomes a bundle's tensor, so the work, even on the meta device, would
    be thrown away. It moved from modeling_utils (4.x) to initialization
    (5.x); a version with neither initialises on the meta device, which
    costs time but no memory."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = __import__(where, fromlist=["no_init_weights"])
        except ImportError:
            continue
        switch = getattr(module, "no_init_weights", None)
        if switch is not None:
            return switch()
    return contextlib.nullcontext()


def _on_cpu(torch):
    """Buffers are made on the CPU, as transformers' loader makes them,
    whatever default device the caller set. With the CPU the default
    already (the usual case) no device context is entered: it would run
    every torch call of the constructor through a Python hook."""
    get = getattr(torch, "get_default_device", None)
    if get is not None and get().type == "cpu":
        return contextlib.nullcontext()
    return torch.device("cpu")


@contextlib.contextmanager
def _parameters_on_meta(torch):
    """Every parameter registered inside the block is moved to the meta
    device as it is registered (accelerate's init_empty_weights without
    buffers): the constructor's initialisation then costs nothing, and the
    real weights are assigned afterwards."""
    Module = torch.nn.Module
    register = Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        p = module._parameters[name]
        if p is None or p.is_meta:
            return
        if type(p) is torch.nn.Parameter:
            q = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
            q.__dict__.update(p.__dict__)
        else:  # subclasses take their attributes as arguments (accelerate's way)
            kwargs = dict(p.__dict__)
            kwargs["requires_grad"] = p.requires_grad
            q = type(p)(p.to("meta"), **kwargs)
        module._parameters[name] = q

    Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        Module.register_parameter = register
