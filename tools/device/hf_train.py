#!/usr/bin/env python3
"""A transformers + PEFT LoRA job of a model our zoo knows, measured by tools/peftplan_callback.py,
for `peftplan compare` against `peftplan plan --profile hf` of the same job (the GPU check of
scripts/device-check.sh; no network, no downloads).

What it does:
  1. writes OUT/<model>/config.json: by default models/zoo/tinyllama-1.1b.json verbatim (embedded
     below, tests/test_hf_train.py holds the two equal) in OUT/tinyllama-1.1b/, so that the
     callback's config hash is the hash `peftplan plan --model OUT/tinyllama-1.1b/config.json`
     (or `--model tinyllama-1.1b`) records, and the plan names the model as the zoo does;
  2. builds that Llama from that config.json with random weights (fixed seed) in bf16, attention
     by --attn-implementation (default sdpa), on the GPU;
  3. wraps it with PEFT LoRA (r 16, alpha 16, dropout 0.1 on q_proj,k_proj,v_proj,o_proj unless
     told otherwise);
  4. trains --steps optimizer steps (default 12) with the transformers Trainer: bf16 mixed
     precision, adamw_torch, constant learning rate, micro-batch × sequence length of random
     tokens from a fixed seed, no evaluation, no saving, report_to none, optionally with
     reentrant gradient checkpointing; tools/peftplan_callback.py's PeftplanCallback writes
     OUT/measurement.json;
  5. writes OUT/plan-args.txt (the `peftplan plan` flags of this very job, one per line, for
     tools/device/hf_compare.sh) and OUT/run.json (what ran: arguments, library versions, GPU,
     parameter counts, losses, the Trainer's metrics), and prints the measured figures.

Run:   python3 tools/device/hf_train.py --out DIR [--steps 12] [--micro-batch 4] [--seq-len 1024]
       tools/device/hf_compare.sh DIR             (plan the same job, then peftplan compare)
       python3 tools/device/hf_train.py --out DIR --print-plan-args   (the flags only; no torch)

Only --print-plan-args and the functions above main() work without torch, transformers and peft
(tests/test_hf_train.py tests them on a machine without transformers). Written for transformers
5.x (`dtype=`, `eval_strategy`, `use_cpu`) with fallbacks for 4.x (`torch_dtype=`,
`evaluation_strategy`, `no_cuda`); arguments a TrainingArguments does not know are dropped and
listed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CALLBACK_DIR = os.path.join(ROOT, "tools")  # tools/peftplan_callback.py

ZOO_NAME = "tinyllama-1.1b"
# models/zoo/tinyllama-1.1b.json (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T), verbatim:
# 1,100,048,384 parameters, 22 layers, hidden 2048, 32 heads, 4 kv heads, intermediate 5632.
TINYLLAMA_CONFIG: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.35.0",
    "use_cache": True,
    "vocab_size": 32000,
}

DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj"
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PLAN = {"sdpa": "flash", "flash_attention_2": "flash", "eager": "eager"}
# GPU name (torch.cuda.get_device_name) -> peftplan cluster preset of one such GPU; the first
# pattern that is in the name wins (catalog: `peftplan clusters`).
GPU_CLUSTERS: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("H200",), "1xH200"),
    (("H100", "PCIe"), "1xH100-PCIe"),
    (("H100",), "1xH100-SXM"),
    (("B200",), "1xB200"),
    (("A100", "40GB"), "1xA100-40GB"),
    (("A100",), "1xA100-80GB"),
    (("L40S",), "1xL40S"),
    (("L4",), "1xL4"),
    (("A10G",), "1xA10G"),
    (("4090",), "1xRTX4090"),
)
DEFAULT_CLUSTER = "1xH200"  # the GPU machine of scripts/device-check.sh


# ---- the model's config ------------------------------------------------------------------------

def model_config(path: Optional[str] = None) -> Dict[str, Any]:
    """The config.json object to train: the file at path, else TinyLlama-1.1B's (a copy)."""
    if path is None:
        return json.loads(json.dumps(TINYLLAMA_CONFIG))
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: a config.json must hold a JSON object")
    return obj


def _kv_heads(config: Dict[str, Any]) -> int:
    kv = config.get("num_key_value_heads")
    return int(kv) if kv is not None else int(config["num_attention_heads"])


def _head_dim(config: Dict[str, Any]) -> int:
    hd = config.get("head_dim")
    return int(hd) if hd is not None else int(config["hidden_size"]) // int(config["num_attention_heads"])


def projection_shapes(config: Dict[str, Any]) -> Dict[str, Tuple[int, int]]:
    """(in_features, out_features) of each Linear of a Llama decoder layer."""
    h, i = int(config["hidden_size"]), int(config["intermediate_size"])
    q = int(config["num_attention_heads"]) * _head_dim(config)
    kv = _kv_heads(config) * _head_dim(config)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def count_parameters(config: Dict[str, Any]) -> int:
    """LlamaForCausalLM's sum(p.numel()): embedding, per layer the seven projections (with the
    q/k/v/o biases when attention_bias) and two RMSNorm weights, the final norm, the head unless
    tied."""
    h, v, n = int(config["hidden_size"]), int(config["vocab_size"]), int(config["num_hidden_layers"])
    shapes = projection_shapes(config)
    layer = sum(a * b for a, b in shapes.values()) + 2 * h
    if config.get("attention_bias"):
        layer += sum(shapes[p][1] for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    head = 0 if config.get("tie_word_embeddings", True) else v * h
    return v * h + n * layer + h + head


def lora_trainable_parameters(config: Dict[str, Any], r: int, targets: Sequence[str]) -> int:
    """PEFT LoRA's trainable parameters: r x (in + out) for each targeted Linear of every layer."""
    shapes = projection_shapes(config)
    return int(config["num_hidden_layers"]) * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


# ---- arguments ---------------------------------------------------------------------------------

def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: `convert` the text, keep it when `ok`, else say it must be `what`."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


_positive_int = _checked(int, lambda v: v > 0, "a positive integer")
_non_negative_int = _checked(int, lambda v: v >= 0, "a non-negative integer")
_dropout = _checked(float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
_positive_float = _checked(float, lambda v: v > 0.0, "a positive number")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf_train.py",
        description="Train a random-weight Llama (default: tinyllama-1.1b's config) with PEFT LoRA under the "
                    "transformers Trainer, measured by tools/peftplan_callback.py, for `peftplan compare`.")
    p.add_argument("--out", required=True, help="output folder (created): <model>/config.json, measurement.json, "
                                                "plan-args.txt, run.json")
    p.add_argument("--config", default=None,
                   help=f"a Llama config.json to train instead of {ZOO_NAME}'s (copied to OUT/<its name>/config.json)")
    p.add_argument("--steps", type=_positive_int, default=12, help="optimizer steps (default 12)")
    p.add_argument("--micro-batch", type=_positive_int, default=4, help="per_device_train_batch_size (default 4)")
    p.add_argument("--seq-len", type=_positive_int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--grad-accum", type=_positive_int, default=1, help="gradient_accumulation_steps (default 1)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="the Trainer's gradient_checkpointing (reentrant, as the planner's --checkpointing full)")
    p.add_argument("--lora-r", type=_positive_int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--lora-alpha", type=_positive_float, default=16.0, help="LoRA alpha (default 16)")
    p.add_argument("--lora-dropout", type=_dropout, default=0.1, help="dropout on the LoRA input (default 0.1)")
    p.add_argument("--lora-targets", default=DEFAULT_TARGETS,
                   help=f"comma list of Llama projections (default {DEFAULT_TARGETS})")
    p.add_argument("--attn-implementation", choices=sorted(ATTENTION_PLAN), default="sdpa",
                   help="transformers' attn_implementation (default sdpa; planned as flash, eager as eager)")
    p.add_argument("--lr", type=_positive_float, default=1e-4, help="learning rate, constant (default 1e-4)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--warmup-steps", type=_non_negative_int, default=2,
                   help="steps the callback leaves out of its statistics (default 2)")
    p.add_argument("--use-cache", action="store_true",
                   help="leave config.use_cache on while training (default off, as fine-tuning scripts set it)")
    p.add_argument("--cluster", default="auto",
                   help="peftplan cluster for the plan (default auto: one GPU of this machine's kind, "
                        f"{DEFAULT_CLUSTER} when it is not known)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (a smoke test with a tiny --config; "
                                                      "memory is then not measured)")
    p.add_argument("--print-plan-args", action="store_true",
                   help="print the `peftplan plan` flags of this job, one per line, and exit (nothing trained)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line, checked: lora targets are Llama projections, the sequence fits the
    config's max_position_embeddings. Exits 2 with a message on bad input (argparse)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        ns.config_obj = model_config(ns.config)
    except (OSError, ValueError) as e:
        parser.error(f"--config: {e}")
    targets = [t.strip() for t in ns.lora_targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in LLAMA_PROJECTIONS]
    if not targets or bad:
        parser.error(f"--lora-targets: must be a comma list of {','.join(LLAMA_PROJECTIONS)}, got {ns.lora_targets!r}")
    if len(set(targets)) != len(targets):
        parser.error(f"--lora-targets: a projection is named twice in {ns.lora_targets!r}")
    ns.targets = targets
    if ns.config_obj.get("model_type") not in ("llama", "mistral"):
        parser.error(f"--config: model_type must be llama (or mistral), got {ns.config_obj.get('model_type')!r}")
    max_pos = ns.config_obj.get("max_position_embeddings")
    if isinstance(max_pos, int) and ns.seq_len > max_pos:
        parser.error(f"--seq-len {ns.seq_len} is more than the model's max_position_embeddings ({max_pos})")
    if ns.warmup_steps >= ns.steps:
        parser.error(f"--warmup-steps {ns.warmup_steps} leaves none of the {ns.steps} steps for the statistics")
    return ns


def cluster_for_gpu(name: Optional[str]) -> Optional[str]:
    """The peftplan cluster preset of one GPU named name (torch.cuda.get_device_name), or None."""
    if not name:
        return None
    for patterns, cluster in GPU_CLUSTERS:
        if all(p in name for p in patterns):
            return cluster
    return None


def plan_args(ns: argparse.Namespace, config_path: str, cluster: str,
              environ: Optional[Dict[str, str]] = None) -> List[str]:
    """`peftplan plan` flags describing this job: the same model file, LoRA, micro-batch, sequence,
    accumulation, checkpointing, attention, bf16 mixed precision, AdamW, one GPU with DDP (a single
    rank), the hf runtime profile, no evaluation; PYTORCH_CUDA_ALLOC_CONF when it is set."""
    environ = os.environ if environ is None else environ
    args = ["--model", config_path,
            "--lora-r", str(ns.lora_r),
            "--lora-alpha", format(ns.lora_alpha, "g"),
            "--lora-dropout", format(ns.lora_dropout, "g"),
            "--lora-targets", ",".join(ns.targets),
            "--cluster", cluster,
            "--gpus", "1",
            "--strategy", "ddp",
            "--profile", "hf",
            "--precision", "bf16",
            "--optimizer", "adamw",
            "--micro-batch", str(ns.micro_batch),
            "--seq-len", str(ns.seq_len),
            "--grad-accum", str(ns.grad_accum),
            "--checkpointing", "full" if ns.gradient_checkpointing else "none",
            "--attention", ATTENTION_PLAN[ns.attn_implementation],
            "--eval-batch", "0"]
    alloc = environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if alloc:
        args += ["--alloc-conf", alloc]
    return args


# ---- library versions --------------------------------------------------------------------------

def major_version(version: Optional[str]) -> Optional[int]:
    """4 of "4.48.1", 5 of "5.0.0rc1"; None when it does not start with a number."""
    if not version:
        return None
    head = version.split(".", 1)[0]
    digits = ""
    for ch in head:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def dtype_keywords(transformers_version: Optional[str]) -> Tuple[str, str]:
    """The from_config keyword for the weights' dtype, first to try then the fallback: `dtype`
    from transformers 5 (4.56 added it, `torch_dtype` deprecated), `torch_dtype` before."""
    major = major_version(transformers_version)
    return ("dtype", "torch_dtype") if major is not None and major >= 5 else ("torch_dtype", "dtype")


def training_arguments_kwargs(ns: argparse.Namespace, output_dir: str,
                              known_fields: Iterable[str]) -> Tuple[Dict[str, Any], List[str]]:
    """TrainingArguments keywords of this job, spelt for the TrainingArguments whose dataclass
    fields are known_fields (eval_strategy or 4.x's evaluation_strategy, use_cpu or no_cuda);
    returns them and the names of wanted ones this version does not know (dropped)."""
    known = set(known_fields)
    want: Dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": ns.steps,
        "per_device_train_batch_size": ns.micro_batch,
        "gradient_accumulation_steps": ns.grad_accum,
        "learning_rate": ns.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "optim": "adamw_torch",  # transformers 5 defaults to adamw_torch_fused on torch >= 2.8
        "bf16": True,
        "fp16": False,
        "gradient_checkpointing": bool(ns.gradient_checkpointing),
        "logging_strategy": "steps",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": ns.seed,
        "data_seed": ns.seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "label_names": ["labels"],
        "remove_unused_columns": False,
        "torch_compile": False,
    }
    if ns.gradient_checkpointing:
        want["gradient_checkpointing_kwargs"] = {"use_reentrant": True}
    want["eval_strategy" if "eval_strategy" in known or "evaluation_strategy" not in known
         else "evaluation_strategy"] = "no"
    if ns.cpu:
        want["use_cpu" if "use_cpu" in known or "no_cuda" not in known else "no_cuda"] = True
    kept = {k: v for k, v in want.items() if k in known}
    dropped = sorted(k for k in want if k not in known)
    return kept, dropped


# ---- the output folder -------------------------------------------------------------------------

def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def model_name(ns: argparse.Namespace) -> str:
    """The model's name: the zoo's, or the --config file's (its folder's when it is config.json)."""
    if ns.config is None:
        return ZOO_NAME
    path = os.path.abspath(ns.config)
    base = os.path.basename(path)
    stem = os.path.basename(os.path.dirname(path)) if base == "config.json" else os.path.splitext(base)[0]
    return stem or "model"


def prepare_out_dir(ns: argparse.Namespace, cluster: str) -> Dict[str, str]:
    """Creates OUT and OUT/<model name>/, writes OUT/<model name>/config.json and
    OUT/plan-args.txt; returns the paths."""
    out = os.path.abspath(ns.out)
    model_dir = os.path.join(out, model_name(ns))  # peftplan names a config.json's model by its folder
    os.makedirs(model_dir, exist_ok=True)
    paths = {"out": out,
             "model_dir": model_dir,
             "config": os.path.join(model_dir, "config.json"),
             "plan_args": os.path.join(out, "plan-args.txt"),
             "measurement": os.path.join(out, "measurement.json"),
             "run": os.path.join(out, "run.json"),
             "trainer": os.path.join(out, "trainer")}
    write_json(paths["config"], ns.config_obj)
    with open(paths["plan_args"], "w", encoding="utf-8") as f:
        f.write("\n".join(plan_args(ns, paths["config"], cluster)) + "\n")
    return paths


def _gib(n: Optional[float]) -> str:
    return "null" if n is None else f"{n / 2**30:.3f} GiB ({int(n):,} B)"


def summary_lines(doc: Dict[str, Any]) -> List[str]:
    """The measured figures of a peftplan-measurement-totals document, as lines to print."""
    m = doc.get("max", {}) or {}
    step, iqr = m.get("step_s"), m.get("step_s_iqr")
    tps = m.get("tokens_per_s_per_gpu")
    lines = [
        f"measured by tools/peftplan_callback.py: {doc.get('steps')} steps, {doc.get('warmup_steps')} left out as warm-up, "
        f"{doc.get('tokens_per_step')} tokens per step",
        "  step (median)           " + ("null" if step is None else f"{step * 1e3:.2f} ms (IQR {iqr * 1e3:.2f} ms)"),
        "  tokens/s per GPU        " + ("null" if tps is None else f"{tps:,.0f}"),
        "  max_memory_allocated    " + _gib(m.get("max_memory_allocated_bytes")),
        "  max_memory_reserved     " + _gib(m.get("max_memory_reserved_bytes")),
        "  device memory used      " + _gib(m.get("device_memory_used_bytes")),
        f"  config_sha256           {(doc.get('model') or {}).get('config_sha256')}",
        "  versions                " + ", ".join(f"{k} {v}" for k, v in (doc.get("versions") or {}).items() if v is not None),
    ]
    for line in doc.get("unavailable") or []:
        lines.append(f"  unavailable: {line}")
    return lines


# ---- training (needs torch, transformers, peft, accelerate) -------------------------------------

def _library_versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {"python": platform.python_version()}
    try:
        from importlib import metadata
    except ImportError:
        metadata = None  # type: ignore
    for name in ("torch", "transformers", "peft", "accelerate", "safetensors", "nvidia-ml-py"):
        version = None
        if metadata is not None:
            try:
                version = metadata.version(name)
            except Exception:
                version = None
        out[name] = version
    return out


def _build_model(ns: argparse.Namespace, config_dir: str, device: str, versions: Dict[str, Optional[str]]) -> Any:
    """The base model from config_dir/config.json, random weights from ns.seed, bf16, on device."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.set_seed(ns.seed)
    config = AutoConfig.from_pretrained(config_dir)  # a local folder: no network
    first, second = dtype_keywords(getattr(transformers, "__version__", versions.get("transformers")))
    attempts = [{first: torch.bfloat16, "attn_implementation": ns.attn_implementation},
                {second: torch.bfloat16, "attn_implementation": ns.attn_implementation}]
    errors = []

    def make() -> Any:
        for kw in attempts:
            try:
                return AutoModelForCausalLM.from_config(config, **kw)
            except TypeError as e:  # the other transformers generation's keyword
                errors.append(f"from_config({', '.join(kw)}): {e}")
        raise RuntimeError("AutoModelForCausalLM.from_config refused both dtype keywords: " + "; ".join(errors))

    model = None
    if device != "cpu":
        try:  # initialise on the GPU: seconds instead of a minute of CPU normal_()
            with torch.device(device):
                model = make()
            if any(getattr(p, "is_meta", False) for p in model.parameters()):
                raise RuntimeError("the model came out on the meta device")
        except Exception as e:
            print(f"hf_train: building under torch.device({device!r}) failed ({type(e).__name__}: {e}); "
                  "building on the CPU and moving", flush=True)
            model = None
            transformers.set_seed(ns.seed)
    if model is None:
        model = make()
    model.to(device)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if dtypes != ["torch.bfloat16"]:
        print(f"hf_train: warning: base parameters in {dtypes}, expected torch.bfloat16; casting", flush=True)
        model.to(torch.bfloat16)
    if not ns.use_cache:
        model.config.use_cache = False
    if ns.gradient_checkpointing:
        # Reentrant checkpointing passes gradients only to inputs that require them: the frozen
        # embedding's output must (PEFT does this itself only in some versions).
        model.enable_input_require_grads()
    return model


def _random_tokens_dataset(n: int, seq_len: int, vocab: int, seed: int) -> Any:
    import torch

    class RandomTokens(torch.utils.data.Dataset):
        """n sequences of random token ids (a fixed generator); labels = input_ids (the model
        shifts them), attention_mask all ones: what a tokenizer's collator hands the model."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, vocab, (n, seq_len), generator=g, dtype=torch.long)

        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> Dict[str, Any]:
            ids = self.ids[i]
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    return RandomTokens()


def train(ns: argparse.Namespace) -> int:
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import dataclasses

    import torch
    import transformers
    from transformers import Trainer, TrainingArguments, default_data_collator
    import peft
    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, CALLBACK_DIR)
    import peftplan_callback

    versions = _library_versions()
    versions["torch"] = torch.__version__
    versions["transformers"] = transformers.__version__
    versions["peft"] = peft.__version__
    if ns.cpu:
        device, gpu = "cpu", None
    else:
        if not torch.cuda.is_available():
            print("hf_train: no CUDA device (torch.cuda.is_available() is False); --cpu trains on the CPU", file=sys.stderr)
            return 2
        device, gpu = "cuda", torch.cuda.get_device_name(0)
        torch.cuda.set_device(0)
    cluster = ns.cluster
    if cluster == "auto":
        cluster = cluster_for_gpu(gpu) or DEFAULT_CLUSTER
        if gpu is not None and cluster_for_gpu(gpu) is None:
            print(f"hf_train: warning: no peftplan cluster for GPU {gpu!r}; planning on {cluster} (--cluster)", flush=True)
    paths = prepare_out_dir(ns, cluster)
    print(f"hf_train: {ZOO_NAME if ns.config is None else ns.config} -> {paths['config']}; GPU {gpu}; "
          f"plan on {cluster}", flush=True)
    print("hf_train: versions " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)

    t0 = time.perf_counter()
    model = _build_model(ns, paths["model_dir"], device, versions)
    base_params = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(r=ns.lora_r, lora_alpha=ns.lora_alpha, lora_dropout=ns.lora_dropout,
                      target_modules=list(ns.targets), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    trainable, total = model.get_nb_trainable_parameters()
    adapter_dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    build_s = time.perf_counter() - t0
    expected_base = count_parameters(ns.config_obj)
    expected_lora = lora_trainable_parameters(ns.config_obj, ns.lora_r, ns.targets)
    print(f"hf_train: model built in {build_s:.1f} s: {base_params:,} base parameters (zoo count {expected_base:,}), "
          f"{trainable:,} trainable (expected {expected_lora:,}) of {total:,}, adapters in {adapter_dtypes}", flush=True)

    fields = [f.name for f in dataclasses.fields(TrainingArguments)]
    kwargs, dropped = training_arguments_kwargs(ns, paths["trainer"], fields)
    if dropped:
        print(f"hf_train: TrainingArguments {transformers.__version__} does not know {dropped}: left out", flush=True)
    args = TrainingArguments(**kwargs)
    data = _random_tokens_dataset(ns.steps * ns.micro_batch * ns.grad_accum, ns.seq_len,
                                  int(ns.config_obj["vocab_size"]), ns.seed + 1)
    callback = peftplan_callback.PeftplanCallback(paths["measurement"], warmup_steps=ns.warmup_steps,
                                                  seq_len=ns.seq_len, config_path=paths["config"])
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                      callbacks=[callback])
    t1 = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - t1

    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    with open(paths["measurement"], encoding="utf-8") as f:
        doc = json.load(f)
    cuda_info: Dict[str, Any] = {}
    if device == "cuda":
        cuda_info = {"max_memory_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                     "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                     "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
                     "mem_efficient_sdp_enabled": torch.backends.cuda.mem_efficient_sdp_enabled(),
                     "capability": list(torch.cuda.get_device_capability(0))}
    run = {
        "writer": "tools/device/hf_train.py",
        "argv": sys.argv[1:],
        "arguments": {k: v for k, v in vars(ns).items() if k != "config_obj"},
        "model": ZOO_NAME if ns.config is None else ns.config,
        "config_path": paths["config"],
        "gpu": gpu,
        "cluster": cluster,
        "versions": versions,
        "training_arguments": {k: (v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v))
                               for k, v in kwargs.items()},
        "training_arguments_dropped": dropped,
        "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
        "params": {"base": base_params, "base_expected": expected_base, "trainable": trainable,
                   "trainable_expected": expected_lora, "all": total, "adapter_dtypes": adapter_dtypes},
        "build_s": build_s,
        "train_s": train_s,
        "losses": losses,
        "trainer_metrics": result.metrics,
        "cuda_at_end": cuda_info,
        "measurement": paths["measurement"],
    }
    write_json(paths["run"], run)

    print(f"hf_train: trained {ns.steps} steps in {train_s:.1f} s; loss {losses[0] if losses else None} -> "
          f"{losses[-1] if losses else None}", flush=True)
    for line in summary_lines(doc):
        print(line)
    print(f"wrote {paths['measurement']}, {paths['run']}, {paths['plan_args']}")
    status = 0
    if trainable != expected_lora or base_params != expected_base:
        print("hf_train: warning: parameter counts differ from the zoo's (see above)")
    if doc.get("world_size") != 1 or (doc.get("max") or {}).get("step_s") is None:
        print("hf_train: the measurement has no step time", file=sys.stderr)
        status = 1
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    if ns.print_plan_args:
        cluster = DEFAULT_CLUSTER if ns.cluster == "auto" else ns.cluster
        config_path = os.path.join(os.path.abspath(ns.out), model_name(ns), "config.json")
        print("\n".join(plan_args(ns, config_path, cluster)))
        return 0
    return train(ns)


if __name__ == "__main__":
    sys.exit(main())
