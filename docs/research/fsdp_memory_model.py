#!/usr/bin/env python3
"""Allocated-memory model of the 2-GPU rows of the fms-acceleration reference set
(accelerate 1.0.1 FSDP1 on torch 2.4.1, transformers 4.48.1, peft 0.13.2, trl 0.13.0,
bitsandbytes 0.43.3; FULL_SHARD, TRANSFORMER_BASED_WRAP, BACKWARD_PRE, use_orig_params=True,
limit_all_gathers=True, reentrant gradient checkpointing, packed 4096-token sequences).

Predicts rank 0's torch.cuda.max_memory_allocated() during train() ("peak") and
torch.cuda.memory_allocated() after train() ("end") for rows A2, A5, A7, A8, A10 (and the
µb-4 companions on CSV lines 13, 37, 45, 61), and the peaks of the out-of-memory points.
Every term is cited in docs/research/fsdp-memory-model.md (section numbers in [] below).
Reuses the single-GPU model docs/research/hf_memory_model.py (imported read-only).
Pure python3, no dependencies.
"""
import os
import sys

sys.dont_write_bytecode = True          # do not leave a __pycache__ next to the imported file
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # hf_memory_model.py beside this file
import hf_memory_model as hf            # noqa: E402  (single-GPU model: shapes, LoRA count, cuBLAS, logits)

GB, GiB = 10**9, 2**30
r512 = hf.r512
WS = 2                                  # world size of all FSDP rows

# ----------------------------------------------------------------------------- configs
MISTRAL = dict(hf.MISTRAL_7B, name="Mistral-7B-v0.1", experts=0)
MIXTRAL = dict(name="Mixtral-8x7B-Instruct-v0.1", H=4096, I=14336, L=32, nh=32, nkv=8,
               V=32000 + 1, tied=False, experts=8, top_k=2)      # +1 pad token [S1.3 of hf doc]; [M] end exact
LLAMA70 = dict(name="Llama-2-70b-hf", H=8192, I=28672, L=80, nh=64, nkv=8,
               V=32000 + 1, tied=False, experts=0)               # +1 pad token; [M] end exact
LORA = hf.LORA                                                   # r 16, q/k/v/o
S = 4096


def attn_shapes(c):
    sh = hf.shapes(c)
    return {k: sh[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj")}


def mlp_shapes(c):
    """(out, in) of every frozen/trainable MLP linear in one decoder layer."""
    H, I = c["H"], c["I"]
    if c["experts"]:
        return [(I, H), (H, I), (I, H)] * c["experts"] + [(c["experts"], H)]   # w1, w2, w3 per expert + router
    return [(I, H), (I, H), (H, I)]                                            # gate, up, down


def layer_linears(c):
    return list(attn_shapes(c).values()) + mlp_shapes(c)


def n_lora_layer(c):
    return sum(LORA["r"] * (o + i) for o, i in attn_shapes(c).values())


# ----------------------------------------------------------------------------- FSDP flat parameters
def flat_numel(numels, itemsize, ws=WS):
    """_flat_param.py _init_flat_param_and_metadata with use_orig_params=True: each original param is
    preceded by alignment padding to 16 B (_get_aligned_numel = 16 // itemsize), then the total is padded
    to a multiple of the world size.  Returns (padded total, unpadded total) [S 1.2]."""
    align = 16 // itemsize
    tot = 0
    for n in numels:
        pad = align - tot % align
        if 0 < pad < align:
            tot += pad
        tot += n
    real = sum(numels)
    pad = ws - tot % ws
    if 0 < pad < ws:
        tot += pad
    return tot, real


def decoder_unit(c, mode):
    """Numels and itemsize of one decoder-layer FlatParameter (LoRA modules excluded: separate units)."""
    H = c["H"]
    if mode == "qlora":   # Params4bit with bnb_4bit_quant_storage=bf16: n/2 bytes = n/4 bf16 elements [S 1.5]
        numels = [o * i // 4 for o, i in attn_shapes(c).values()] + \
                 [o * i // 4 if (o, i) != (c["experts"], H) else o * i for o, i in mlp_shapes(c)] + [H, H]
        if c["experts"]:
            raise ValueError("this model covers QLoRA for dense decoders only (no published QLoRA MoE row under FSDP)")
    else:
        numels = [o * i for o, i in layer_linears(c)] + [H, H]
    return flat_numel(numels, 2)


def root_unit(c):
    H, V = c["H"], c["V"]
    numels = [V * H, H] + ([] if c["tied"] else [V * H])          # embed_tokens, final norm, lm_head
    return flat_numel(numels, 2)


def lora_units(c):
    """peft fsdp_auto_wrap_policy: every leaf module whose weight requires grad is its own unit [S 1.4]."""
    out = []
    for o, i in attn_shapes(c).values():
        out += [flat_numel([LORA["r"] * i], 4), flat_numel([o * LORA["r"]], 4)]   # lora_A (r x in), lora_B (out x r)
    return out


def quant_state_bytes(c):
    """bnb QuantState per 4-bit weight, replicated (not a parameter, so FSDP does not shard it) [S 1.5]."""
    q = 0
    for o, i in layer_linears(c):
        n = o * i
        blocks = n // 64
        q += r512(blocks) + r512(-(-blocks // 256) * 4) + 512 + 512
    return c["L"] * q + 1024


def shard(padded, itemsize, ws=WS):
    return padded // ws * itemsize


# ----------------------------------------------------------------------------- end state
CUBLAS = hf.N_CUBLAS_WS * hf.CUBLAS_WS
FIXED_SMALL = 2560          # [M]: 5 x 512-B scalar blocks (single-GPU model had 4); exact in all 9 end values


def end_state(c, mode, B):
    """memory_allocated() after train() on rank 0."""
    T = B * S
    L = c["L"]
    dec_pad, dec_real = decoder_unit(c, mode)
    root_pad, root_real = root_unit(c)
    parts = {}
    parts["decoder shards"] = L * shard(dec_pad, 2)
    parts["root shard"] = shard(root_pad, 2)
    if mode == "qlora":
        parts["quant states (replicated)"] = quant_state_bytes(c)
    if mode == "full":
        # bf16 sharded grads (flat_param.grad survives zero_grad with use_orig_params) + bf16 m, v over the
        # rank's unpadded slice of the original params [S 2.3, 2.4]
        parts["sharded grads"] = parts["decoder shards"] + parts["root shard"]
        parts["adam m,v"] = 2 * 2 * (L * dec_real + root_real) // WS
    else:
        lu = lora_units(c)
        lora_shard = L * sum(shard(p, 4) for p, _ in lu)
        parts["LoRA shards (fp32)"] = lora_shard
        parts["LoRA sharded grads (fp32)"] = lora_shard
        parts["adam m,v (fp32)"] = 2 * 4 * L * sum(r for _, r in lu) // WS
    parts["cuBLAS workspaces"] = CUBLAS
    parts["batch (3 x int64)"] = hf.BATCH_BYTES_PER_TOKEN * T
    parts["scalars"] = FIXED_SMALL
    return sum(parts.values()), parts


# ----------------------------------------------------------------------------- peak candidates
def layer_internals(c, mode):
    """Bytes/token alive inside one recomputed decoder layer at the MLP MulBackward (saved set of the
    layer + the MLP's three transient grads), excluding the layer input/output/grad tensors [S 2.8 of
    the hf doc; here in section 3.4].  mode: 'lora' (bf16 base, fp32 adapters, no AMP) or
    'qlora' (nf4 base, bf16 norms, bf16 adapters under FSDP MixedPrecision + autocast)."""
    H, I, nh, nkv, r = c["H"], c["I"], c["nh"], c["nkv"], LORA["r"]
    kv = nkv * (H // nh)
    norms = 2 * (4 * H + 4)                       # each RMSNorm saves its fp32 copy + fp32 rsqrt (4 B/token)
    flash = 2 * H + 2 * kv + 2 * kv + 2 * H + 4 * nh   # q, k, v, out (bf16), softmax_lse (fp32)
    if mode == "lora":
        lora = 4 * (4 * H + H) + 4 * 4 * r        # per target: fp32 dropout output (saved by lora_A) + bool mask; lora_A outs fp32
    else:
        lora = 4 * (2 * H + H) + 4 * 2 * r        # bf16 dropout output + mask; bf16 lora_A outs
    attn = norms + lora + flash
    if c["experts"]:
        mlp = moe_internals(c)
    else:
        mlp = 6 * I + 6 * I                       # saved gate, act, up + grad_prod, grad_act, grad_up (bf16)
    return attn, mlp


def moe_internals(c, load=None):
    """MixtralSparseMoeBlock with frozen experts, at the MulBackward of the first expert processed in
    backward (expert 7).  Saved per routed token: w1 out, silu out, w3 out (6I), w2 out (2H, saved by the
    mul with the routing weight), rw slice, index tensors; per token: softmax result fp32 (8 x 4), topk
    indices (2 x 8), div_ operands.  Transient: 6I per token routed to that expert.  `load` = fraction of
    the T tokens routed to that expert: 2/8 for balanced top-2 routing [I]; data-dependent [M]."""
    H, I, E, k = c["H"], c["I"], c["experts"], c["top_k"]
    if load is None:
        load = k / E
    saved = k * (6 * I + 2 * H + 2 + 16) + (4 * E + 8 * k + 12)
    return saved + int(round(6 * I * load))


def frozen_backward_peak(c, mode, B):
    """Peak inside the backward of decoder layer 0 (the last one processed) for frozen decoder units.
    FSDP registers _post_backward_reshard_only_hook = register_multi_grad_hook(layer inputs) in every
    recomputed forward; the hook closure keeps the AccumulateGrad of the detached checkpoint input, which
    keeps that input and its .grad alive until _finalize_params removes the hook after the whole backward
    [S 3.3].  So at layer 0: all L checkpoint inputs + L-1 input grads (one of them is layer 0's incoming
    grad) + the recomputed output + the layer's internals, plus the root (never resharded in forward,
    frozen so only the catch-all reshard frees it) and layer 0 all-gathered, plus the prefetched
    o_proj.lora_B of layer 0 (BACKWARD_PRE targets the handle recorded just before layer 0's post-forward)."""
    H, L = c["H"], c["L"]
    T = B * S
    end, _ = end_state(c, mode, B)
    dec_pad, _ = decoder_unit(c, mode)
    root_pad, _ = root_unit(c)
    attn, mlp = layer_internals(c, mode)
    itemsize_lora_unsharded = 4 if mode == "lora" else 2          # MixedPrecision(param_dtype=bf16) for bnb rows
    o, _i = attn_shapes(c)["o_proj"]
    hd = H // c["nh"]
    per_tok = dict(
        gc_store=2 * H * L,
        retained_input_grads=2 * H * (L - 1),
        recomputed_output=2 * H,
        attention_saved=attn,
        mlp_saved_and_transients=mlp,
    )
    parts = dict(
        end_state=end,
        minus_layer0_lora_grads=-(shard(sum(p for p, _ in lora_units(c)), 4)),
        root_unsharded=root_pad * 2,
        layer0_unsharded=dec_pad * 2,
        prefetched_lora_B=o * LORA["r"] * itemsize_lora_unsharded,
        cos_sin_cache_position=2 * r512(S * hd * 2) + r512(S * 8),
        activations=sum(per_tok.values()) * T,
    )
    return sum(parts.values()), parts, per_tok


def loss_forward_peak(c, mode, B):
    """End of forward at log_softmax (single-GPU model's 14V/token chain) + root all-gathered; no grads
    (flat grads freed in _root_pre_forward via _reset_flat_param_grad_info_if_needed)."""
    H, L = c["H"], c["L"]
    T = B * S
    end, ep = end_state(c, mode, B)
    grads = ep.get("LoRA sharded grads (fp32)", 0) + ep.get("sharded grads", 0)
    root_pad, _ = root_unit(c)
    hd = H // c["nh"]
    parts = dict(end_minus_grads=end - grads, root_unsharded=root_pad * 2,
                 gc_store=2 * H * L * T, final_norm=6 * H * T,
                 logits=hf.logits_bytes(c, B, S), small=hf.small_forward(c, B, S))
    return sum(parts.values()), parts


def optimizer_step_peak(c, mode, B):
    """torch 2.4 foreach AdamW: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs): one state-sized copy of
    the rank's optimizer slice, on top of sharded params + grads + m + v (all in end_state)."""
    end, ep = end_state(c, mode, B)
    sqrt = ep.get("adam m,v", 0) // 2 + ep.get("adam m,v (fp32)", 0) // 2
    return end + sqrt, dict(end_state=end, sqrt_tmp=sqrt)


def full_backward_peak(c, B):
    """Full FT (decoder flat params trainable, so no multi-grad hook and no retention): end of layer 0's
    backward, when its SplitWithSizes view grads (unsharded) and their concatenation (flat_param.grad,
    unsharded) coexist with layer 0 gathered, the root gathered, the held lm_head/norm view grads of the
    root (released only when the embedding grad arrives), the sharded grads of layers 1..L-1, params,
    m, v.  Activations at that moment: layer 0's input + its grad [I]."""
    H, L, V = c["H"], c["L"], c["V"]
    T = B * S
    end, ep = end_state(c, "full", B)
    dec_pad, _ = decoder_unit(c, "full")
    root_pad, _ = root_unit(c)
    parts = dict(
        params_m_v=ep["decoder shards"] + ep["root shard"] + ep["adam m,v"],
        sharded_grads_layers_1_to_L1=(L - 1) * shard(dec_pad, 2),
        fixed=ep["cuBLAS workspaces"] + ep["batch (3 x int64)"] + ep["scalars"],
        root_unsharded=root_pad * 2,
        root_lm_head_and_norm_grads=2 * (V * H + H),
        layer0_unsharded=dec_pad * 2,
        layer0_view_grads_plus_cat=2 * dec_pad * 2,
        activations=(2 * H + 2 * H) * T,
    )
    return sum(parts.values()), parts


def predict(c, mode, B):
    cands = {"optimizer_step": optimizer_step_peak(c, mode, B)[:2],
             "loss_forward": loss_forward_peak(c, mode, B)[:2]}
    if mode == "full":
        cands["layer0_backward"] = full_backward_peak(c, B)[:2]
    else:
        cands["layer0_backward"] = frozen_backward_peak(c, mode, B)[:2]
    where = max(cands, key=lambda k: cands[k][0])
    return cands, where


ROWS = [  # id, config, mode, µb per GPU, measured peak, measured end, CSV line
    ("A2", MISTRAL, "full", 2, 36_225_939_968, 28_984_199_680, 11),
    ("L13", MISTRAL, "full", 4, 36_226_136_576, 28_984_396_288, 13),
    ("A5", MISTRAL, "lora", 2, 15_144_870_400, 7_368_030_720, 35),
    ("L37", MISTRAL, "lora", 4, 21_959_827_968, 7_368_227_328, 37),
    ("A7", MISTRAL, "qlora", 2, 9_424_594_432, 2_244_525_568, 59),
    ("L61", MISTRAL, "qlora", 4, 15_970_067_968, 2_244_722_176, 61),
    ("A8", MIXTRAL, "lora", 2, 57_554_708_992, 46_829_091_328, 43),
    ("L45", MIXTRAL, "lora", 4, 64_851_605_504, 46_829_287_936, 45),
    ("A10", LLAMA70, "qlora", 2, 46_685_287_936, 19_266_743_808, 67),
]

OOM_2GPU = [  # id, config, mode, µb, CSV line
    ("Mixtral full FT", MIXTRAL, "full", 2, 19),
    ("Mixtral full FT", MIXTRAL, "full", 4, 21),
    ("Llama-2-70b full FT", LLAMA70, "full", 2, 27),
    ("Llama-2-70b full FT", LLAMA70, "full", 4, 29),
    ("Llama-2-70b LoRA bf16", LLAMA70, "lora", 2, 51),
    ("Llama-2-70b LoRA bf16", LLAMA70, "lora", 4, 53),
    ("Llama-2-70b QLoRA baseline", LLAMA70, "qlora", 4, 69),
]


def single_gpu_oom():
    """1-GPU OOM points with the single-GPU model (dense configs only; MoE via a weights lower bound)."""
    out = []
    for name, c, mode, B, line in [("Llama-2-70b QLoRA baseline 1 GPU", LLAMA70, "qlora", 4, 66),
                                   ("Llama-2-70b QLoRA baseline 1 GPU", LLAMA70, "qlora", 8, 68),
                                   ("Llama-2-70b LoRA bf16 1 GPU", LLAMA70, "lora", 4, 50),
                                   ("Llama-2-70b full FT 1 GPU", LLAMA70, "full", 4, 26)]:
        st, _, cands, where = hf.predict(c, mode, LORA, B, S)
        out.append((name, B, line, cands[where][0], where))
    # Mixtral on one GPU: bf16 weights alone (attention + 8 experts + embeddings) exceed the card
    c = MIXTRAL
    P = c["L"] * (sum(o * i for o, i in layer_linears(c)) + 2 * c["H"]) + 2 * c["V"] * c["H"] + c["H"]
    out.append(("Mixtral LoRA/full 1 GPU (bf16 weights only)", 4, "18,20,42,44", 2 * P, "lower bound"))
    return out


def main():
    print("2-GPU FSDP rows (rank 0). Bytes.")
    hdr = (f"{'row':4} {'model':27} {'mode':5} {'uB':>2} | {'pred peak':>15} {'meas peak':>15} {'err':>8} "
           f"{'peak at':>16} | {'pred end':>15} {'meas end':>15} {'err':>8}")
    print(hdr)
    print("-" * len(hdr))
    for rid, c, mode, B, mp, me, line in ROWS:
        cands, where = predict(c, mode, B)
        pk = cands[where][0]
        en, _ = end_state(c, mode, B)
        print(f"{rid:4} {c['name']:27} {mode:5} {B:2d} | {pk:15,d} {mp:15,d} {(pk - mp) / mp * 100:+7.4f}% "
              f"{where:>16} | {en:15,d} {me:15,d} {(en - me) / me * 100:+7.4f}%")
    print()
    for rid, c, mode, B, mp, me, line in ROWS:
        cands, where = predict(c, mode, B)
        print(f"{rid} (CSV {line}): " + ", ".join(f"{k}={v[0] / GiB:.3f} GiB" for k, v in cands.items()))
        print("    " + where + ": " + ", ".join(f"{k}={v / GiB:.4f}" for k, v in cands[where][1].items()))
        if where == "layer0_backward" and mode != "full":
            _, _, pt = frozen_backward_peak(c, mode, B)
            print("    per token: " + ", ".join(f"{k}={v:,}" for k, v in pt.items()) + f"  (sum {sum(pt.values()):,})")
    print()
    print("Per-token slopes (peak(µb4) - peak(µb2)) / 8192, measured vs model:")
    pairs = [("A5", "L37"), ("A7", "L61"), ("A8", "L45"), ("A2", "L13")]
    by = {r[0]: r for r in ROWS}
    for a, b in pairs:
        ra, rb = by[a], by[b]
        meas = (rb[4] - ra[4]) / (WS * S)
        pa = predict(ra[1], ra[2], ra[3]); pb = predict(rb[1], rb[2], rb[3])
        model = (pb[0][pb[1]][0] - pa[0][pa[1]][0]) / (WS * S)
        print(f"  {a}->{b}: measured {meas:,.1f} B/token, model {model:,.1f} B/token")
    print()
    print("Mixtral expert-load sensitivity (A8): load = share of the T tokens routed to the first expert"
          " processed in backward")
    c = MIXTRAL
    for load in (0.25, 0.40, 0.49, 0.75, 1.0):
        save = moe_internals
        globals()["moe_internals"] = lambda cc, load=load: save(cc, load)
        pk = predict(c, "lora", 2)[0]["layer0_backward"][0]
        globals()["moe_internals"] = save
        print(f"  load {load:.2f}: A8 peak {pk:,d} ({(pk - 57_554_708_992) / 57_554_708_992 * 100:+.3f}%)")
    print()
    print("Out-of-memory points, 2 GPUs (A100-80GB: 85.9e9 B total; the failed runs show 79.5-80.8 GiB"
          " in nvidia-smi):")
    for name, c, mode, B, line in OOM_2GPU:
        cands, where = predict(c, mode, B)
        en, _ = end_state(c, mode, B)
        pk = cands[where][0]
        flag = "> 80 GB" if pk > 80 * GB else "< 80 GB (allocated only)"
        print(f"  CSV {line:3d} {name:27} uB {B}: peak {pk / GB:8.2f} GB ({where}), end {en / GB:7.2f} GB  {flag}")
    print()
    print("Out-of-memory points, 1 GPU (single-GPU model, dense configs; Mixtral by a weights lower bound):")
    for name, B, line, pk, where in single_gpu_oom():
        flag = "> 80 GB" if pk > 80 * GB else "< 80 GB"
        print(f"  CSV {line}: {name:44} uB {B}: {pk / GB:8.2f} GB ({where})  {flag}")


if __name__ == "__main__":
    main()
