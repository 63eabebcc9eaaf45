"""Records what a real training job measured, for `peftplan compare plan.json measurement.json`.

Drop this one file beside a training script: a transformers Trainer job (plain, DeepSpeed or FSDP,
launched by accelerate, deepspeed or torchrun) adds `PeftplanCallback()` to its callbacks; a
hand-written loop calls `record_step()` after every optimizer step and `write_measurement(path)`
once at the end. Rank 0 writes one JSON file (schema "peftplan.measurement-totals/1"): every
rank's optimizer-step times, their median and spread, tokens/s, and peak device memory, plus the
worst rank, the model's config hash and the library versions.

What it deliberately does not do: it records totals only (no per-category memory, no per-op
times, no collective bytes; those need our own executor), it never changes the training (no
hooks on the model, no extra collectives except the one gather inside write_measurement), and it
needs only the standard library and torch at import time. transformers, peft, pynvml,
huggingface_hub and friends are used when they import; when something is missing the field it
would have filled is null and the "unavailable" list says why. Only bad arguments raise.
"""
from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

SCHEMA = "peftplan.measurement-totals/1"
WRITER = "tools/peftplan_callback.py"

# The architecture fields the planner reads from config.json.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size")
# Other spellings of the same fields in config.json files (transformers' attribute_map of GPT-2,
# GPT-J, OPT and Falcon); used only when the canonical key is missing from the file.
_ARCHITECTURE_ALIASES = {
    "hidden_size": ("n_embd", "d_model"),
    "num_hidden_layers": ("n_layer", "num_layers"),
    "num_attention_heads": ("n_head", "num_heads"),
    "num_key_value_heads": ("num_kv_heads", "n_head_kv"),
    "intermediate_size": ("n_inner", "ffn_dim"),
}
# Version fields: the distribution names to ask importlib.metadata, in order.
_VERSION_DISTRIBUTIONS = (("transformers", ("transformers",)), ("peft", ("peft",)),
                          ("accelerate", ("accelerate",)), ("deepspeed", ("deepspeed",)),
                          ("bitsandbytes", ("bitsandbytes",)),
                          ("pynvml", ("nvidia-ml-py", "pynvml", "nvidia-ml-py3")))


# ---- statistics --------------------------------------------------------------------------------

def percentile(values: List[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks: numpy's
    default (method="linear", numpy.percentile docs): position (n - 1) * q / 100 in the sorted
    values, interpolated between its two neighbours."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: List[float]) -> float:
    return percentile(values, 50.0)


def interquartile_range(values: List[float]) -> float:
    """q3 - q1, each as percentile() computes it."""
    return percentile(values, 75.0) - percentile(values, 25.0)


def steady_steps(step_times_s: List[float], warmup_steps: int) -> List[float]:
    """The steps the statistics are taken over: those after the first warmup_steps, or all of
    them when there are not more than warmup_steps."""
    return list(step_times_s[warmup_steps:]) if len(step_times_s) > warmup_steps else list(step_times_s)


# ---- the model's config ------------------------------------------------------------------------

def canonical_json(obj: Any) -> bytes:
    """The bytes config_sha256 hashes: sorted keys, no spaces, UTF-8 (not \\u escapes)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def config_sha256(obj: Any) -> str:
    """sha256 (hex) of canonical_json(obj), obj being the parsed config.json object. Key order and
    whitespace in the file do not change it; any value does."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def _read_json_object(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: a config.json must hold a JSON object, got {type(obj).__name__}")
    return obj


def _find_hf_config(model: Any) -> Any:
    """model.config of a transformers model, looking through PEFT (get_base_model(), base_model)
    and DDP/FSDP/DeepSpeed wrappers (module). None when there is none."""
    todo, seen = [model], set()
    while todo:
        m = todo.pop(0)
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        try:
            cfg = getattr(m, "config", None)
        except Exception:
            cfg = None
        if cfg is not None and hasattr(cfg, "to_dict"):
            return cfg
        for name in ("get_base_model", "base_model", "module", "model"):
            try:
                nxt = getattr(m, name, None)
                todo.append(nxt() if name == "get_base_model" and callable(nxt) else nxt)
            except Exception:
                pass
    return None


def _config_file_of(hf_config: Any) -> Optional[str]:
    """The config.json the model was loaded from: <name_or_path>/config.json for a local folder,
    else the Hugging Face cache's copy when huggingface_hub finds one (no download)."""
    name = getattr(hf_config, "name_or_path", None) or getattr(hf_config, "_name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    local = os.path.join(name, "config.json")
    if os.path.isfile(local):
        return local
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str) and os.path.isfile(cached):
            return cached
    except Exception:
        pass
    return None


def _as_int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _architecture(obj: Optional[Dict[str, Any]], hf_config: Any) -> Dict[str, Any]:
    """The ARCHITECTURE_KEYS from the config object (or its text_config), then from model.config
    (whose attribute_map knows each family's spellings); missing ones null.
    num_key_value_heads defaults to num_attention_heads (multi-head attention)."""
    sources = []
    if obj is not None:
        sources.append(obj)
        if isinstance(obj.get("text_config"), dict):
            sources.append(obj["text_config"])
    arch: Dict[str, Any] = {}
    for key in ARCHITECTURE_KEYS:
        value = None
        for src in sources:
            for k in (key,) + _ARCHITECTURE_ALIASES.get(key, ()):
                if src.get(k) is not None:
                    value = src[k]
                    break
            if value is not None:
                break
        if value is None and hf_config is not None:
            try:
                value = getattr(hf_config, key, None)
            except Exception:
                value = None
        arch[key] = (value if isinstance(value, str) else None) if key == "model_type" else _as_int(value)
    if arch["num_key_value_heads"] is None:
        arch["num_key_value_heads"] = arch["num_attention_heads"]
    return arch


def _model_section(model: Any, config_path: Optional[str], missing: List[str]) -> Dict[str, Any]:
    obj, source = None, None
    hf_config = _find_hf_config(model) if model is not None else None
    if config_path is not None:
        try:
            obj = _read_json_object(config_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"config_path {config_path!r} is not a readable config.json: {e}") from None
        source = "file"
    elif model is None:
        missing.append("model: no model and no config_path were given (pass model= or config_path=)")
    elif hf_config is None:
        missing.append("model: the model has no transformers config (model.config); pass config_path=")
    else:
        path = _config_file_of(hf_config)
        if path is not None:
            try:
                obj, source = _read_json_object(path), "file"
            except (OSError, ValueError):
                obj = None
        if obj is None:
            try:
                obj, source = hf_config.to_dict(), "config.to_dict"
                json.dumps(obj)
            except Exception as e:
                obj, source = None, None
                missing.append(f"model: model.config.to_dict() is not JSON ({e}); pass config_path=")
    sha = None
    if obj is not None:
        try:
            sha = config_sha256(obj)
        except (TypeError, ValueError) as e:
            missing.append(f"model.config_sha256: the config is not JSON ({e})")
    arch = _architecture(obj, hf_config)
    for key in ARCHITECTURE_KEYS:
        if arch[key] is None and (obj is not None or hf_config is not None):
            missing.append(f"model.architecture.{key}: not in the config")
    return {"config_sha256": sha, "config_source": source if sha is not None else None,
            "architecture": arch}


# ---- environment -------------------------------------------------------------------------------

def _distribution_version(names: Tuple[str, ...]) -> Optional[str]:
    try:
        from importlib import metadata
    except ImportError:  # Python 3.7
        return None
    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            continue
    return None


def _versions(missing: List[str]) -> Dict[str, Optional[str]]:
    v: Dict[str, Optional[str]] = {"python": platform.python_version(), "torch": torch.__version__}
    for field, dists in _VERSION_DISTRIBUTIONS:
        found = _distribution_version(dists)
        module = sys.modules.get(field)
        if found is None and module is not None:
            found = getattr(module, "__version__", None)
        v[field] = found if isinstance(found, str) else None
    v["cuda"] = torch.version.cuda
    v["nccl"] = None
    if torch.version.cuda is not None:
        try:
            nccl = torch.cuda.nccl.version()
            v["nccl"] = ".".join(str(p) for p in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception:
            pass
    absent = [k for k, _ in _VERSION_DISTRIBUTIONS if v[k] is None]
    if absent:
        missing.append(", ".join("versions." + k for k in absent) + ": not installed in this Python environment")
    if torch.version.cuda is None:
        missing.append("versions.cuda, versions.nccl: this torch was built without CUDA (torch.version.cuda is None)")
    elif v["nccl"] is None:
        missing.append("versions.nccl: torch.cuda.nccl.version() failed (torch built without NCCL?)")
    # Key order as the schema lists it.
    order = ("python", "torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes",
             "cuda", "nccl", "pynvml")
    return {k: v[k] for k in order}


def _cuda_unused_reason() -> Optional[str]:
    """None when this process uses a CUDA device, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not torch.cuda.is_initialized():
        return "CUDA was never initialised in this process (the job ran on the CPU)"
    return None


def _cpu_name() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _host_memory_bytes() -> Optional[int]:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _rank_and_world() -> Tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- device memory as nvidia-smi reports it ------------------------------------------------------

def _nvml_handle(pynvml: Any, cuda_index: int) -> Any:
    """The NVML handle of CUDA device cuda_index of this process. NVML numbers every GPU of the
    machine and ignores CUDA_VISIBLE_DEVICES, so: by the device's UUID when torch reports it
    (exact), else through CUDA_VISIBLE_DEVICES (an index, or a UUID or its prefix), else the same
    index. Integer indices agree with NVML's order when CUDA_DEVICE_ORDER=PCI_BUS_ID or the GPUs
    are all alike (CUDA's default fastest-first order breaks ties by PCI bus id)."""
    def by_uuid(text: str) -> Any:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(text)
        except TypeError:  # older pynvml wants bytes
            return pynvml.nvmlDeviceGetHandleByUUID(text.encode())

    uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            return by_uuid(text if text.startswith(("GPU-", "MIG-")) else "GPU-" + text)
        except Exception:
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = [e.strip() for e in visible.split(",") if e.strip()][cuda_index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        full = pynvml.nvmlDeviceGetUUID(handle)
        full = full.decode() if isinstance(full, bytes) else full
        if full.startswith(entry):
            return handle
    return by_uuid(entry)


class _DeviceMemory:
    """Device memory in use on this process's GPU, the whole device as nvidia-smi shows it (all
    processes, CUDA context included): NVML's used bytes when pynvml imports, else
    cudaMemGetInfo's total - free. Read at every record_step and at the end, keeping the largest:
    a sampled peak, so a spike between two samples is missed; nvidia-smi's own readings are
    sampled too."""

    def __init__(self) -> None:
        self._pynvml: Any = None                 # the module, once nvmlInit succeeded
        self._handles: Dict[int, Any] = {}       # CUDA device index -> NVML handle
        self._nvml_error: Optional[str] = None   # why NVML is not used; then cudaMemGetInfo is
        self.peak_bytes: Optional[int] = None    # largest reading since the last reset_peak
        self.source: Optional[str] = None        # "pynvml" or "cudaMemGetInfo"
        self.error: Optional[str] = None         # why no reading was taken

    def reset_peak(self) -> None:
        self.peak_bytes, self.source, self.error = None, None, None

    def _read(self) -> Tuple[int, str]:
        index = torch.cuda.current_device()
        if self._nvml_error is None:
            try:
                if self._pynvml is None:
                    import pynvml
                    pynvml.nvmlInit()
                    self._pynvml = pynvml
                if index not in self._handles:
                    self._handles[index] = _nvml_handle(self._pynvml, index)
                return int(self._pynvml.nvmlDeviceGetMemoryInfo(self._handles[index]).used), "pynvml"
            except Exception as e:
                self._nvml_error = f"pynvml: {type(e).__name__}: {e}"
        free, total = torch.cuda.mem_get_info(index)
        return int(total) - int(free), "cudaMemGetInfo"

    def sample(self) -> None:
        if _cuda_unused_reason() is not None:
            return
        try:
            used, source = self._read()
        except Exception as e:
            self.error = f"{self._nvml_error or 'pynvml not used'}; cudaMemGetInfo: {type(e).__name__}: {e}"
            return
        if self.source is not None and source != self.source:
            # Readings from two sources do not mix; keep the first source's peak.
            return
        self.source = source
        self.peak_bytes = used if self.peak_bytes is None else max(self.peak_bytes, used)


# ---- the recorder ------------------------------------------------------------------------------

def _check_tokens(tokens: Any, what: str) -> Optional[int]:
    """tokens as an int (ints, numpy ints, integral floats, one-element tensors); None stays None."""
    if tokens is None:
        return None
    if isinstance(tokens, torch.Tensor):
        if tokens.numel() != 1:
            raise ValueError(f"{what} must be one number of tokens, got a tensor of shape {tuple(tokens.shape)}")
        tokens = tokens.item()
    if not isinstance(tokens, (int, float, bool)) and hasattr(tokens, "__index__"):
        tokens = operator.index(tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or \
            (isinstance(tokens, float) and not tokens.is_integer()) or tokens < 0:
        raise ValueError(f"{what} must be a non-negative whole number of tokens, got {tokens!r}")
    return int(tokens)


def _check_warmup(warmup_steps: Any) -> int:
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
    return warmup_steps


def _check_output_path(path: Any) -> str:
    try:
        path = os.fspath(path)
    except TypeError:
        raise ValueError(f"the measurement path must be a file path, got {path!r}") from None
    if not isinstance(path, str) or not path:
        raise ValueError(f"the measurement path must be a non-empty file path, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write the measurement to {path!r}: its folder {folder!r} does not "
                         "exist; create it first or choose another path")
    if os.path.isdir(path):
        raise ValueError(f"cannot write the measurement to {path!r}: it is a folder; name a file")
    return path


def write_atomic(path: str, text: str) -> None:
    """Writes text to path so that a reader sees the old file or the whole new one: a temporary
    file beside it (path + ".tmp.<pid>"), fsync, os.replace. The temporary file is removed when
    anything fails."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; not possible everywhere (Windows), so best effort
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _merge_unavailable(records: List[Dict[str, Any]]) -> List[str]:
    """One line per (field, reason); names the ranks when not every rank shares it."""
    groups: Dict[Tuple[str, str], List[int]] = {}
    for rec in records:
        for field, reason in rec["unavailable"]:
            groups.setdefault((field, reason), []).append(rec["rank"])
    lines = []
    for (field, reason), ranks in groups.items():
        if len(ranks) == len(records):
            lines.append(f"{field}: {reason}")
        else:
            label = "rank" if len(ranks) == 1 else "ranks"
            lines.append(f"{field} ({label} {', '.join(str(r) for r in sorted(ranks))}): {reason}")
    return lines


def _worst(per_rank: List[Dict[str, Any]], missing: List[str]) -> Dict[str, Any]:
    """The worst rank's numbers: slowest step, lowest tokens/s, most memory. Ranks whose field is
    null are left out; null when every rank's is."""
    def known(key: str) -> List[Dict[str, Any]]:
        return [r for r in per_rank if r[key] is not None]

    timed = known("step_s")
    slowest = max(timed, key=lambda r: r["step_s"]) if timed else None
    out: Dict[str, Any] = {
        "step_s": slowest["step_s"] if slowest else None,
        "step_s_iqr": slowest["step_s_iqr"] if slowest else None,
        "tokens_per_s_per_gpu": min(r["tokens_per_s_per_gpu"] for r in known("tokens_per_s_per_gpu"))
        if known("tokens_per_s_per_gpu") else None,
    }
    for key in ("max_memory_allocated_bytes", "max_memory_reserved_bytes", "device_memory_used_bytes"):
        out[key] = max(r[key] for r in known(key)) if known(key) else None
    out["rank_of_step_s"] = slowest["rank"] if slowest else None
    empty = [key for key, value in out.items() if value is None]
    if empty:
        missing.append(", ".join("max." + k for k in empty) + ": null on every rank (see the lines above)")
    return out


class Recorder:
    """One rank's optimizer-step record. The clock starts when the recorder is made and restarts
    at start() and after write_measurement(); step k lasts from stamp k-1 (or that start) to stamp
    k, so the first step includes whatever ran before it since the start (data loading, compile,
    CUDA warm-up): that is what warmup_steps leaves out."""

    def __init__(self, tokens_per_step: Optional[int] = None) -> None:
        self._memory = _DeviceMemory()
        self.no_tokens_hint = "pass start(tokens_per_step=...) or record_step(tokens=...)"
        self.start(tokens_per_step)

    def start(self, tokens_per_step: Optional[int] = None) -> None:
        """Forgets the steps so far and restarts the clock. tokens_per_step: tokens this rank
        processes in one optimizer step (all its micro-batches), used when record_step gets none."""
        self.tokens_per_step = _check_tokens(tokens_per_step, "tokens_per_step")
        self.step_times_s: List[float] = []           # seconds of each optimizer step
        self.step_tokens: List[Optional[int]] = []    # tokens of each step on this rank
        self._memory.reset_peak()
        self._last_stamp_s = time.perf_counter()

    def record_step(self, tokens: Optional[int] = None) -> None:
        """Marks the end of one optimizer step: waits for the GPU's queued work, then stamps the
        time. tokens: this rank's tokens in the step (default: start's tokens_per_step)."""
        tokens = _check_tokens(tokens, "tokens")
        if _cuda_unused_reason() is None:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.step_times_s.append(now - self._last_stamp_s)
        self.step_tokens.append(tokens if tokens is not None else self.tokens_per_step)
        self._last_stamp_s = now
        self._memory.sample()  # after the stamp; its few microseconds land in the next step

    def rank_record(self, warmup_steps: int = 1) -> Dict[str, Any]:
        """This rank's entry of per_rank, plus "unavailable": (field, reason) pairs."""
        warmup_steps = _check_warmup(warmup_steps)
        rank, world = _rank_and_world()
        missing: List[Tuple[str, str]] = []
        steady = steady_steps(self.step_times_s, warmup_steps)
        step_s = median(steady) if steady else None
        iqr = interquartile_range(steady) if steady else None
        tokens: Optional[float] = None
        tokens_per_s: Optional[float] = None
        if not steady:
            for key in ("step_s", "step_s_iqr", "tokens_per_step", "tokens_per_s_per_gpu"):
                missing.append((key, "no optimizer steps were recorded (record_step was never called)"))
        else:
            counted = self.step_tokens[len(self.step_tokens) - len(steady):]
            if all(t is not None for t in counted):
                mean = sum(counted) / len(counted)  # every step's tokens alike in a usual job
                tokens = int(mean) if float(mean).is_integer() else mean
                if step_s > 0:
                    tokens_per_s = tokens / step_s
                else:
                    missing.append(("tokens_per_s_per_gpu", "the median step took no measurable time"))
            else:
                why = f"the tokens each step processed were not given ({self.no_tokens_hint})"
                missing.append(("tokens_per_step", why))
                missing.append(("tokens_per_s_per_gpu", why))

        local_rank: Optional[int] = None
        try:
            local_rank = int(os.environ["LOCAL_RANK"])
        except (KeyError, ValueError):
            if world == 1:
                local_rank = 0
            else:
                missing.append(("local_rank", "LOCAL_RANK is not set (the launcher sets it: torchrun, accelerate, deepspeed)"))

        cuda_reason = _cuda_unused_reason()
        allocated = reserved = None
        if cuda_reason is None:
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            device = {"type": "cuda", "name": props.name, "total_memory_bytes": int(props.total_memory)}
            allocated = int(torch.cuda.max_memory_allocated(index))
            reserved = int(torch.cuda.max_memory_reserved(index))
            self._memory.sample()
        else:
            device = {"type": "cpu", "name": _cpu_name(), "total_memory_bytes": _host_memory_bytes()}
            for key in ("max_memory_allocated_bytes", "max_memory_reserved_bytes"):
                missing.append((key, cuda_reason))
        if device["name"] is None:
            missing.append(("device.name", "the operating system does not say"))
        if device["total_memory_bytes"] is None:
            missing.append(("device.total_memory_bytes", "the operating system does not say"))
        used, used_source = self._memory.peak_bytes, self._memory.source
        if used is None:
            why = cuda_reason or self._memory.error or "no reading was taken"
            missing.append(("device_memory_used_bytes", why))
            missing.append(("device_memory_used_source", "no device memory reading"))
        return {
            "rank": rank,
            "local_rank": local_rank,
            "device": device,
            "step_times_s": list(self.step_times_s),
            "steps_after_warmup": len(steady),
            "step_s": step_s,
            "step_s_iqr": iqr,
            "tokens_per_step": tokens,
            "tokens_per_s_per_gpu": tokens_per_s,
            "max_memory_allocated_bytes": allocated,
            "max_memory_reserved_bytes": reserved,
            "device_memory_used_bytes": used,
            "device_memory_used_source": used_source,
            "unavailable": missing,
        }

    def write_measurement(self, path: Any, *, model: Any = None, config_path: Optional[str] = None,
                          warmup_steps: int = 1) -> Optional[Dict[str, Any]]:
        """Gathers every rank's record to rank 0 and writes the measurement there (see the module
        function of the same name). Returns the document on rank 0, None elsewhere."""
        warmup_steps = _check_warmup(warmup_steps)
        record = self.rank_record(warmup_steps)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            records: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(records, record)
            rank = dist.get_rank()
        else:
            records, rank = [record], 0
        if rank != 0:
            self.start(self.tokens_per_step)
            return None
        path = _check_output_path(path)
        records.sort(key=lambda r: r["rank"])
        missing: List[str] = []
        model_section = _model_section(model, config_path, missing)
        versions = _versions(missing)
        per_rank = [{k: v for k, v in r.items() if k != "unavailable"} for r in records]
        tokens = [r["tokens_per_step"] for r in per_rank]
        # Null when a rank's is; that rank's "tokens_per_step" line says why.
        total_tokens = sum(tokens) if tokens and all(t is not None for t in tokens) else None
        worst = _worst(per_rank, missing)
        doc = {
            "schema": SCHEMA,
            "writer": WRITER,
            "world_size": len(records),
            "warmup_steps": warmup_steps,
            "steps": len(records[0]["step_times_s"]),
            "tokens_per_step": total_tokens,
            "model": model_section,
            "versions": versions,
            "per_rank": per_rank,
            "max": worst,
            "unavailable": _merge_unavailable(records) + missing,
        }
        write_atomic(path, json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
        self.start(self.tokens_per_step)
        return doc


# ---- the two functions for a hand-written loop ---------------------------------------------------

_default = Recorder()


def start(tokens_per_step: Optional[int] = None) -> None:
    """Optional: restarts the default recorder's clock and forgets its steps. Without it the first
    step is timed from this module's import (or from the last write_measurement)."""
    _default.start(tokens_per_step)


def record_step(tokens: Optional[int] = None) -> None:
    """Call once at the end of every optimizer step (after optimizer.step()). Synchronises CUDA
    when it is in use and stamps time.perf_counter(); step k lasts from stamp k-1 to stamp k, the
    first from start() (else module import or the last write_measurement). tokens: the tokens
    this rank processed in the step, all micro-batches (default: start's tokens_per_step)."""
    _default.record_step(tokens)


def write_measurement(path: Any, *, model: Any = None, config_path: Optional[str] = None,
                      warmup_steps: int = 1) -> Optional[Dict[str, Any]]:
    """Call once after training, on every rank when torch.distributed is initialised (it gathers
    with all_gather_object; under NCCL each rank must have called torch.cuda.set_device first).
    Rank 0 writes path atomically; the other ranks write nothing. model: the trained model (its
    config is hashed); config_path: the config.json to hash instead. The statistics leave out the
    first warmup_steps steps. Then the default recorder starts afresh (tokens_per_step kept).
    Returns the document on rank 0, None elsewhere. ValueError for a negative warmup_steps, a path
    whose folder does not exist, or an unreadable config_path."""
    return _default.write_measurement(path, model=model, config_path=config_path, warmup_steps=warmup_steps)


# ---- the transformers Trainer callback ----------------------------------------------------------

class _CallbackLogic:
    """What PeftplanCallback does, apart from being a TrainerCallback."""

    def __init__(self, path: Any = "peftplan-measurement.json", warmup_steps: int = 1,
                 tokens_per_step: Optional[int] = None, seq_len: Optional[int] = None,
                 config_path: Optional[str] = None) -> None:
        try:
            self.path = os.fspath(path)
        except TypeError:
            raise ValueError(f"path must be a file path, got {path!r}") from None
        self.warmup_steps = _check_warmup(warmup_steps)
        self.tokens_per_step = _check_tokens(tokens_per_step, "tokens_per_step")
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0):
            raise ValueError(f"seq_len must be a positive integer (tokens per sequence), got {seq_len!r}")
        self.seq_len = seq_len
        if config_path is not None and not os.path.isfile(config_path):
            raise ValueError(f"config_path {config_path!r} is not a file (name the model's config.json)")
        self.config_path = config_path
        self.recorder = Recorder()
        self.recorder.no_tokens_hint = "pass tokens_per_step=... or seq_len=... to PeftplanCallback"

    def _tokens_for(self, args: Any) -> Optional[int]:
        """This rank's tokens per optimizer step: B x accumulation x S (padding included)."""
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        if self.seq_len is None:
            return None
        try:
            return int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * self.seq_len
        except (AttributeError, TypeError, ValueError):
            return None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if _cuda_unused_reason() is None:
            torch.cuda.reset_peak_memory_stats()
        self.recorder.start(self._tokens_for(args))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.record_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.write_measurement(self.path, model=kwargs.get("model"),
                                        config_path=self.config_path, warmup_steps=self.warmup_steps)


def _make_callback_class() -> type:
    try:
        from transformers import TrainerCallback
    except Exception as e:  # not installed, or broken: either way there is no Trainer to call us
        reason = f"{type(e).__name__}: {e}"

        class PeftplanCallback:  # the stand-in when transformers is missing
            """Needs transformers; raises ImportError when made."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError("PeftplanCallback needs transformers (pip install transformers); "
                                  f"importing it failed: {reason}. Without transformers, call "
                                  "record_step() and write_measurement() from your loop instead.")
        return PeftplanCallback

    class PeftplanCallback(_CallbackLogic, TrainerCallback):
        """transformers Trainer callback: times every optimizer step (on_step_end) from
        on_train_begin and writes the measurement at on_train_end, on rank 0.
        Arguments: path of the JSON; warmup_steps left out of the statistics; tokens_per_step of
        one rank, else per_device_train_batch_size x gradient_accumulation_steps x seq_len;
        config_path of the model's config.json (default: found from the model)."""
    return PeftplanCallback


def __getattr__(name: str) -> Any:
    """PeftplanCallback is made on first use, so that plain record_step users never import
    transformers (a few seconds, and sometimes a broken install)."""
    if name == "PeftplanCallback":
        cls = _make_callback_class()
        globals()["PeftplanCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# PeftplanCallback is made by __getattr__ above on first use (pyflakes cannot see it).
__all__ = ["Recorder", "PeftplanCallback", "start", "record_step", "write_measurement",
           "config_sha256", "canonical_json", "percentile", "median", "interquartile_range",
           "SCHEMA"]
