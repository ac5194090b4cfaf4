"""Streamed writing of Hugging Face weights (safetensors shards + `model.safetensors.index.json`).

No process ever holds the whole model in CPU memory: the tensor list (names, shapes, dtypes) is
known before any weight is gathered (ZeRO-3 keeps `ds_shape`), so the shard layout and every
shard's safetensors header are computed up front; then the weights are gathered from ZeRO-3 one
group at a time (`generation.GATHER_CHUNK_NUMEL` elements, one coalesced all-gather each), and each
tensor is cast to the export dtype, copied to CPU and appended to its shard file by the rank that
owns the shard, then freed. Peak CPU memory of a writer: one tensor in the export dtype; peak
device memory: one gathered group.

Shards are spread over the ranks of node 0 (shard i is written by rank i mod
local_world_size), so 8 processes write a 70B model's shards in parallel while every rank takes
part in the gathers; no rank waits long on another's file work.

The safetensors format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian
header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, ...,
"__metadata__": {"format": "pt"}} (padded with spaces to a multiple of 8), then the raw
little-endian bytes of each tensor in offset order. Shard names, the index file and
`max_shard_size` follow transformers' `save_pretrained` (one file `model.safetensors` when one
shard suffices, else `model-0000i-of-0000n.safetensors` and the index).
"""
from __future__ import annotations

import copy
import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ds_ppo.engine import dist

log = logging.getLogger("ds_ppo")
DEFAULT_MAX_SHARD_SIZE = "5GB"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of a size as transformers writes them: an int, "5GB" (10^9) or "5GiB" (2^30)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"not a size: {size!r} (write e.g. 5GB, 500MB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class Entry:
    """One tensor of the written state dict."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive entries cut into shards of at most max_bytes (a larger tensor gets a shard of
    its own), the way transformers' split_torch_state_dict_into_shards sizes them."""
    shards: list[list[Entry]] = []
    size = 0
    for e in entries:
        if not shards or (shards[-1] and size + e.nbytes > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards or [[]]


def shard_file_names(n: int) -> list[str]:
    return [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                         for i in range(n)]


def safetensors_header(entries: list[Entry]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding `entries` in this order."""
    header, offset = {}, 0
    for e in entries:
        header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Writes `entries` into safetensors shards under out_dir, tensor by tensor, in entry order.

    With `writers` > 1, rank r writes shards r, r + writers, ...; `write` is called by every rank
    for every entry, in order, and is a no-op (no CPU copy) for entries of shards this rank does
    not own. `close` checks every owned tensor was written; rank 0 writes the index."""

    def __init__(self, out_dir: str | Path, entries: list[Entry], max_shard_size: int | str,
                 rank: int = 0, writers: int = 1):
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(entries, parse_size(max_shard_size))
        self.files = shard_file_names(len(self.shards))
        self.rank, self.writers = rank, writers
        if rank == 0 or any(self._mine(i) for i in range(len(self.shards))):
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shard_of = {e.name: i for i, shard in enumerate(self.shards) for e in shard}
        self.entry = {e.name: e for e in entries}
        self.left = {i: [e.name for e in s] for i, s in enumerate(self.shards) if self._mine(i)}
        self._open: tuple[int, object] | None = None
        self.total_bytes = sum(e.nbytes for e in entries)

    def _mine(self, shard: int) -> bool:
        return shard % self.writers == self.rank

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor (any device; cast to its entry's dtype, copied to CPU here)."""
        shard = self.shard_of[name]
        if not self._mine(shard):
            return
        expected = self.left[shard].pop(0) if self.left[shard] else None
        if expected != name:
            raise RuntimeError(f"tensor {name} written out of order (expected {expected})")
        e = self.entry[name]
        if tuple(tensor.shape) != e.shape:
            raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} != planned {e.shape}")
        f = self._file(shard)
        cpu = tensor.detach().to(dtype=e.dtype).to("cpu").contiguous()
        if cpu.numel():
            f.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))
        del cpu
        if not self.left[shard]:
            f.close()
            self._open = None

    def _file(self, shard: int):
        if self._open is not None and self._open[0] == shard:
            return self._open[1]
        if self._open is not None:
            raise RuntimeError(f"shard {self.files[self._open[0]]} left incomplete")
        f = open(self.out_dir / self.files[shard], "wb")
        f.write(safetensors_header(self.shards[shard]))
        self._open = (shard, f)
        return f

    def close(self) -> None:
        """Write shards that hold no tensor (an empty model), check completeness, write the index
        (rank 0, only when there are several shards)."""
        for shard, left in self.left.items():
            if left:
                raise RuntimeError(f"shard {self.files[shard]} is missing {left[:3]}...")
            if not self.shards[shard]:
                (self.out_dir / self.files[shard]).write_bytes(safetensors_header([]))
        if self.rank == 0 and len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes,
                                  "total_parameters": sum(e.nbytes // e.dtype.itemsize
                                                          for e in self.entry.values())},
                     "weight_map": {n: self.files[i] for n, i in self.shard_of.items()}}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True)
                                                   + "\n")


def _export_dtype(t_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if t_dtype.is_floating_point else t_dtype


def _persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds (non-persistent ones, e.g. rotary frequencies, are not)."""
    for mod_name, mod in module.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in skip:
                yield (f"{mod_name}.{name}" if mod_name else name), b


def _needs_conversion(module: torch.nn.Module) -> bool:
    """True for models whose transformers class renames/merges weights on load (e.g. MoE experts
    in transformers 5): their saved names differ from the module's, so save_pretrained's reverse
    conversion is needed. Tied weights appear once in named_parameters(), as in save_pretrained.
    (Not `module._weight_conversions`: under ZeRO-3 transformers stores there every mapping it
    tried, legacy renames included, even for models such as Llama whose names never change.)"""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return False
    try:
        conversions = get_model_conversion_mapping(module, add_legacy=False)
    except Exception:  # an architecture the mapping does not know
        return False
    return any(not isinstance(c, PrefixChange) for c in conversions or [])


def saved_names(hf: torch.nn.Module, module: torch.nn.Module | None = None
                ) -> dict[str, list[tuple[str, tuple[int, ...]]]] | None:
    """For a model whose saved weights transformers renames or splits (`_needs_conversion`: a
    mixture-of-experts layer's fused (E, ...) expert tensors are saved as one tensor per
    expert): each parameter's name -> the (name, shape) of the tensors save_pretrained writes
    for it, from transformers' reverse conversion applied to that parameter alone (on meta
    tensors: nothing is gathered); None when some conversion needs several parameters at once
    (then only a whole state dict converts). `module`: the model as trained (a LoRA or ZeRO-3
    one; default `hf`), whose parameter names and full shapes (`ds_shape`) are read."""
    from transformers.core_model_loading import revert_weight_conversion

    from ds_ppo.engine.generation import _param_chunks

    from ds_ppo.engine.lora import weight_shape

    shapes = {name: weight_shape(ps, full)
              for chunk in _param_chunks(module if module is not None else hf, 2**62)
              for name, ps, full in chunk}
    meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    try:
        whole = revert_weight_conversion(hf, dict(meta))
        each = {n: [(k, tuple(v.shape)) for k, v in revert_weight_conversion(
            hf, {n: t}).items()] for n, t in meta.items()}
    except Exception:  # a conversion that needs the other parameters of its group
        return None
    flat = {k: s for outs in each.values() for k, s in outs}
    if flat != {k: tuple(v.shape) for k, v in whole.items()}:
        return None
    return each


def write_module_weights(module: torch.nn.Module, out_dir: str | Path, dtype: torch.dtype,
                         max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                         group_numel: int | None = None) -> None:
    """Collective: stream a (possibly ZeRO-3-partitioned) model's weights into safetensors shards.

    Every rank gathers the groups in the same order; the ranks of node 0 write the shards they
    own. Floating tensors are cast to `dtype`. A plain (non-ZeRO) module works too (the gathers
    are no-ops), one process writing everything."""
    import deepspeed

    from ds_ppo.engine.generation import GATHER_CHUNK_NUMEL, _param_chunks
    from ds_ppo.engine.lora import plain_model

    # (name in the plain HF model, parameters to gather, the full tensor once gathered): a LoRA
    # model's adapted weights come merged (W + alpha / r x B A), tied weights once
    chunks = list(_param_chunks(module, group_numel or GATHER_CHUNK_NUMEL))
    hf = plain_model(module)
    buffers = [(n.replace(".base_layer.", "."), b) for n, b in _persistent_buffers(hf)]
    # names as save_pretrained writes them: a mixture-of-experts model's fused expert
    # tensors split per expert (`saved_names`), each tensor converted once gathered
    renamed = saved_names(hf, module) if _needs_conversion(hf) else None
    from ds_ppo.engine.lora import weight_shape

    entries = [Entry(out, shape, _export_dtype(ps[0].dtype, dtype))
               for chunk in chunks for name, ps, full in chunk
               for out, shape in (renamed[name] if renamed is not None else
                                  [(name, weight_shape(ps, full))])]
    entries += [Entry(n, tuple(b.shape), _export_dtype(b.dtype, dtype)) for n, b in buffers]
    writers = min(dist.local_world_size(), dist.world_size())
    writer = ShardedWriter(out_dir, entries, max_shard_size, dist.rank(), writers)
    for chunk in chunks:
        with deepspeed.zero.GatheredParameters([p for _, ps, _ in chunk for p in ps],
                                               modifier_rank=None):
            for name, _, full in chunk:
                if renamed is None:
                    writer.write(name, full())
                    continue
                from transformers.core_model_loading import revert_weight_conversion

                for out, tensor in revert_weight_conversion(hf, {name: full()}).items():
                    writer.write(out, tensor)
    for name, b in buffers:
        writer.write(name, b)
    writer.close()


def saved_config(module: torch.nn.Module):
    """A copy of the model's HF config as checkpoints and exports write it: with the dropout
    probabilities that training switched off (policy/value.disable_dropout; recorded on the model
    as `ds_ppo_dropout`) put back, so a model trained further from the export has its own."""
    config = copy.deepcopy(module.config)
    for dotted, value in (getattr(module, "ds_ppo_dropout", None) or {}).items():
        *subs, name = dotted.split(".")
        target = config
        for sub in subs:
            target = getattr(target, sub)
        setattr(target, name, value)
    return config


def _hf_config_copy(module: torch.nn.Module, dtype: torch.dtype):
    config = saved_config(module)
    # as save_pretrained records it: the class that wrote the weights (a reward model's
    # export says ...ForSequenceClassification, which the critic-from-RM load reads)
    config.architectures = [type(module).__name__]
    config.use_cache = True
    config.dtype = str(dtype).split(".")[1]  # what save_pretrained records
    return config


def save_module(module: torch.nn.Module, tokenizer, out_dir: str | Path, dtype: torch.dtype,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Collective: a Hugging Face directory (config, generation config, tokenizer, streamed
    safetensors weights) of a (ZeRO-3) model, loadable with `from_pretrained`. Ends with a
    barrier, which waits only for the last shard of each writer."""
    from ds_ppo.engine.lora import plain_model

    out_dir = Path(out_dir)
    hf = plain_model(module)  # a LoRA model's weights are written merged, as a plain model's
    if _needs_conversion(hf) and saved_names(hf, module) is None:
        _save_module_gathered(module, out_dir, dtype, max_shard_size)
    else:
        write_module_weights(module, out_dir, dtype, max_shard_size)
    if dist.is_main():
        _hf_config_copy(hf, dtype).save_pretrained(out_dir)
        gen = getattr(hf, "generation_config", None)
        if gen is not None and getattr(hf, "can_generate", lambda: False)():
            gen.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    dist.barrier()
    return out_dir


def _save_module_gathered(module, out_dir: Path, dtype: torch.dtype, max_shard_size) -> None:
    """The whole model on rank 0's CPU and save_pretrained (weights only kept): for models whose
    saved names need transformers' reverse weight conversion, which works on whole state dicts."""
    from ds_ppo.engine.generation import build_replica

    log.warning("%s renames its weights on load: exporting through save_pretrained, which holds "
                "the whole model in rank 0's CPU memory", type(module).__name__)
    model = build_replica(module, dtype, torch.device("cpu"), materialize=dist.is_main())
    if model is not None:
        model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)


def _source_files(src: Path) -> list[Path]:
    index = src / INDEX_NAME
    if index.exists():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [src / n for n in names]
    return [src / SINGLE_NAME]


def copy_safetensors_weights(src: str | Path, out_dir: str | Path, dtype: torch.dtype,
                             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """One process: rewrite a directory's safetensors weights (one file or sharded) in `dtype`
    into out_dir, one tensor in memory at a time (the sources are memory-mapped)."""
    from safetensors import safe_open

    files = _source_files(Path(src))
    entries, where = [], {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                st_dtype = {v: k for k, v in _ST_DTYPES.items()}[sl.get_dtype()]
                entries.append(Entry(name, tuple(sl.get_shape()), _export_dtype(st_dtype, dtype)))
                where[name] = path
    writer = ShardedWriter(out_dir, entries, max_shard_size)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                writer.write(name, f.get_tensor(name))
    writer.close()
