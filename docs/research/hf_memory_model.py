#!/usr/bin/env python3
"""Allocated-memory model of a transformers 4.48.1 + PEFT 0.13.2 (+ bitsandbytes 0.43.3)
training step, as run by fms-hf-tuning 2.5.0 / trl 0.13.0 on torch 2.4.1 (A100), reentrant
gradient checkpointing, packed fixed-length sequences, flash-attention-2.

Predicts, for the published fms-acceleration rows A1, A3, A4, A6 (single GPU, Mistral-7B-v0.1):
  * steady  = torch.cuda.memory_allocated() at the end of train()   ("alloc at end")
  * peak    = torch.cuda.max_memory_allocated() during train()      ("peak torch alloc")
The sources behind every term are listed in docs/research/hf-memory-model.md (section numbers in []).
Pure python3, no dependencies.
"""

GiB = 2**30


def r512(n):
    """CUDA caching allocator rounds every block up to a multiple of 512 B (kMinBlockSize) [S9]."""
    return -(-int(n) // 512) * 512


# ----------------------------------------------------------------------------- config
MISTRAL_7B = dict(
    H=4096, I=14336, L=32, nh=32, nkv=8,
    V=32000 + 1,  # fms-hf-tuning adds one pad token and resizes (multiple_of=1) [S1.3]
    tied=False,
)

LORA = dict(r=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))

# torch 2.4 CublasHandlePool.cpp default for non-sm90: ":4096:2:16:8" = 4096*1024*2 + 16*1024*8 B,
# one per (cuBLAS handle, stream); handles are per thread -> main thread + autograd device thread [S7]
CUBLAS_WS = 4096 * 1024 * 2 + 16 * 1024 * 8   # 8,519,680 B
N_CUBLAS_WS = 2
# batch kept alive by the Trainer loop: input_ids, attention_mask, labels, all int64 [S1.4]
BATCH_BYTES_PER_TOKEN = 3 * 8
SMALL_FIXED = 2048  # Trainer scalars (tr_loss, grad_norm, ...) 4 x 512 B blocks [inferred]


def shapes(c):
    H, I, nh, nkv = c["H"], c["I"], c["nh"], c["nkv"]
    hd = H // nh
    return {  # (out_features, in_features)
        "q_proj": (nh * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H),
        "o_proj": (H, nh * hd), "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I),
    }


def n_params(c):
    H, L, V = c["H"], c["L"], c["V"]
    per_layer = sum(o * i for o, i in shapes(c).values()) + 2 * H  # + 2 RMSNorm weights
    emb = V * H * (1 if c["tied"] else 2)
    return emb + L * per_layer + H  # + final norm


def n_lora(c, lora):
    sh = shapes(c)
    return c["L"] * sum(lora["r"] * (sh[t][0] + sh[t][1]) for t in lora["targets"])


def fixed_bytes(B, S):
    return N_CUBLAS_WS * CUBLAS_WS + BATCH_BYTES_PER_TOKEN * B * S + SMALL_FIXED


# ----------------------------------------------------------------------------- steady state
def weights_bytes(c, mode, lora):
    """mode: 'full' | 'lora' (pure bf16 base) | 'qlora' (bnb nf4 + double quant, baseline path)."""
    H, L, V = c["H"], c["L"], c["V"]
    if mode in ("full", "lora"):
        base = 2 * n_params(c)                       # bf16 everywhere (torch_dtype=bf16, no AMP) [S1.1]
    else:
        q = 0
        for o, i in shapes(c).values():              # Params4bit + QuantState, bnb 0.43.3 [S6]
            n = o * i
            blocks = n // 64
            q += (r512(n // 2)                        # packed nf4, uint8 storage
                  + r512(blocks)                      # absmax quantised to uint8 (compress_statistics)
                  + r512(-(-blocks // 256) * 4)       # state2.absmax fp32 (blocksize 256)
                  + 512                               # nf4 code (16 fp32), get_4bit_type per weight
                  + 512)                              # offset = absmax.mean() (0-dim fp32)
        q = L * q + 1024                              # + shared 'dynamic' 256-entry map (name2qmap)
        emb = V * H * 2 * (1 if c["tied"] else 2)     # embed/lm_head: fp32 by prepare_model_for_kbit_training,
                                                      # back to bf16 by trl peft_module_casting_to_bf16 [S4,S5]
        norms = (2 * L + 1) * H * 4                   # norms stay fp32 [S4,S5]
        base = q + emb + norms
    if mode == "full":
        return base, 0
    return base, 4 * n_lora(c, lora)                  # adapters upcast/created fp32 (autocast_adapter_dtype) [S3]


def steady(c, mode, lora, B, S):
    base, lora_b = weights_bytes(c, mode, lora)
    trainable = base if mode == "full" else lora_b
    adam = 2 * trainable                              # exp_avg, exp_avg_sq = zeros_like(param) -> param dtype [S8]
    # grads freed by optimizer.zero_grad / model.zero_grad(set_to_none=True) [S2.5]
    parts = dict(weights=base, lora=lora_b, adam_states=adam, fixed=fixed_bytes(B, S))
    return sum(parts.values()), parts


# ----------------------------------------------------------------------------- peak candidates
def logits_bytes(c, B, S):
    """transformers 4.48.1 ForCausalLMLoss: logits bf16 (kept by the model output) + .float() copy +
    logits[..., :-1, :].contiguous() copy + log_softmax result (saved for nll/log_softmax backward) [S2.3]."""
    V = c["V"]
    T, Tv = B * S, B * (S - 1)
    return 2 * V * T + 4 * V * T + 4 * V * Tv + 4 * V * Tv


def small_forward(c, B, S):
    hd = c["H"] // c["nh"]
    return (2 * r512(S * hd * 2)        # cos, sin (1,S,hd) bf16, kept by checkpoint ctx
            + r512(S * 8)               # cache_position / position_ids int64
            + r512(B * (S - 1) * 8))    # shift_labels .contiguous() int64


def loss_forward_peak(c, mode, lora, B, S):
    """Peak at log_softmax inside the loss, end of the forward pass (no grads exist yet)."""
    H, L = c["H"], c["L"]
    T = B * S
    st, _ = steady(c, mode, lora, B, S)
    if mode in ("full", "lora"):
        gc_store = L * 2 * H * T                      # bf16 input of each checkpointed layer [S2.2,S7b]
        final_norm = (4 * H + 2 * H) * T              # saved fp32 copy of input + bf16 output kept in outputs
        amp_cache = 0
    else:
        gc_store = (2 * H + (L - 1) * 4 * H) * T      # layer 0 input bf16 (embedding), others fp32 (fp32 norms) [S2.1]
        final_norm = (4 * H + 4 * H) * T              # saved input (fp32, no copy) + fp32 output
        amp_cache = 2 * n_lora(c, lora)               # autocast cache: bf16 copies of fp32 leaf LoRA weights
    parts = dict(steady=st, gc_store=gc_store, final_norm=final_norm,
                 logits=logits_bytes(c, B, S), small=small_forward(c, B, S), amp_cache=amp_cache)
    return sum(parts.values()), parts


def last_layer_recompute_peak(c, mode, lora, B, S):
    """Peak inside the backward of the last (recomputed) decoder layer, at MulBackward of the MLP
    (saved gate/act/up + grad_prod + grad_act + grad_up alive).  Per-token bytes."""
    H, I, L, nh, nkv = c["H"], c["I"], c["L"], c["nh"], c["nkv"]
    hd = H // nh
    kv = nkv * hd
    r = lora["r"]
    T = B * S
    st, _ = steady(c, mode, lora, B, S)
    grads_lora = 4 * n_lora(c, lora) // L if mode != "full" else 0   # only this layer's grads exist yet (approx)
    if mode == "lora":      # bf16 activations, fp32 LoRA branch (no autocast)
        gc_store = L * 2 * H
        grad_in = 2 * H
        attn_saved = (4 * H                             # input_layernorm: fp32 copy of input
                      + 3 * (4 * H + H)                 # q,k,v LoRA: fp32 dropout output + bool mask
                      + (2 * H + 2 * kv + 2 * kv + 2 * H)  # flash-attn saves q,k,v (bf16) and out
                      + nh * 4                          # softmax_lse fp32
                      + (4 * H + H)                     # o LoRA: fp32 dropout output + mask
                      + 4 * 4 * r                       # lora_A outputs fp32
                      + 4 * H)                          # post_attention_layernorm fp32 copy
        out = 2 * H
        mlp = 3 * 2 * I + 3 * 2 * I                     # saved gate, act, up + 3 transient grads
    elif mode == "qlora":   # fp32 norms -> fp32 residual stream and MLP, autocast bf16 matmuls
        gc_store = 2 * H + (L - 1) * 4 * H
        grad_in = 4 * H
        attn_saved = (3 * (2 * H + H)                   # q,k,v LoRA: bf16 (autocast) copy saved by lora_A mm + mask
                      + (2 * H + 2 * kv + 2 * kv + 2 * H)  # flash q,k,v cast to bf16 + out
                      + nh * 4
                      + (2 * H + H)                     # o LoRA: bf16 dropout output + mask
                      + 4 * 2 * r
                      + 4 * H)                          # post-norm saves its fp32 input (residual mid)
        out = 4 * H
        mlp = 3 * 4 * I + 3 * 4 * I                     # fp32 gate, act, up + 3 fp32 transient grads
    else:                   # full FT: worst recompute is layer 0 (all other grads exist); rough, not the peak
        gc_store = 2 * H                                # only layer 0's input is left in the store
        grad_in = 2 * H
        attn_saved = (4 * H + 2 * H                     # norm fp32 copy + bf16 normed (saved by mul and q/k/v mm)
                      + (2 * H + 2 * kv + 2 * kv + 2 * H) + nh * 4   # flash q,k,v,out (o_proj input = view of out)
                      + 4 * H + 2 * H)                  # post-norm fp32 copy + bf16 normed
        out = 2 * H
        mlp = 3 * 2 * I + 2 * I + 3 * 2 * I             # gate, act, up, down input + transient grads
        per_layer = sum(o * i for o, i in shapes(c).values()) + 2 * H
        grads_lora = 2 * (n_params(c) - per_layer - c["V"] * H)   # bf16 grads of everything but layer 0 / embed
    per_tok = gc_store + grad_in + attn_saved + out + mlp
    parts = dict(steady=st, activations=per_tok * T + small_forward(c, B, S), grads=grads_lora)
    return sum(parts.values()), parts


def optimizer_step_peak(c, mode, lora, B, S):
    """torch 2.4 _multi_tensor_adamw (foreach default on CUDA): params + grads + exp_avg + exp_avg_sq
    + exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs) (a full copy in the state dtype) [S8]."""
    st, parts = steady(c, mode, lora, B, S)
    trainable = parts["weights"] if mode == "full" else parts["lora"]
    p = dict(steady=st, grads=trainable, sqrt_tmp=trainable)
    return sum(p.values()), p


def predict(c, mode, lora, B, S):
    st, st_parts = steady(c, mode, lora, B, S)
    cands = {
        "loss_forward": loss_forward_peak(c, mode, lora, B, S),
        "last_layer_recompute": last_layer_recompute_peak(c, mode, lora, B, S),
        "optimizer_step": optimizer_step_peak(c, mode, lora, B, S),
    }
    where = max(cands, key=lambda k: cands[k][0])
    return st, st_parts, cands, where


ROWS = [
    # id, mode, micro-batch, measured peak, measured alloc at end (bytes), CSV line
    ("A1", "full", 4, 72_434_837_504, 43_467_876_352, 10),
    ("A1@ub8", "full", 8, 72_435_230_720, None, 12),   # same scenario, uB 8 (only peak quoted)
    ("A3", "lora", 4, 26_704_571_904, 14_664_493_056, 34),
    ("A4", "lora", 8, 38_742_912_512, 14_664_886_272, 36),
    ("A6", "qlora", 4, 20_669_338_112, 4_307_028_992, 58),
]


def main():
    c, S = MISTRAL_7B, 4096
    print(f"Mistral-7B-v0.1 params (V={c['V']}): {n_params(c):,}; LoRA params: {n_lora(c, LORA):,}")
    hdr = f"{'row':7} {'mode':5} {'uB':>3} | {'pred peak':>16} {'meas peak':>16} {'err':>9} {'peak at':>20} | {'pred end':>16} {'meas end':>16} {'err':>9}"
    print(hdr)
    print("-" * len(hdr))
    for rid, mode, B, mpeak, mend, _line in ROWS:
        st, st_parts, cands, where = predict(c, mode, LORA, B, S)
        pk = cands[where][0]
        e1 = (pk - mpeak) / mpeak * 100
        end_s = f"{st:16,d} {mend:16,d} {(st - mend) / mend * 100:+8.4f}%" if mend else f"{st:16,d} {'-':>16} {'':>9}"
        print(f"{rid:7} {mode:5} {B:3d} | {pk:16,d} {mpeak:16,d} {e1:+8.4f}% {where:>20} | {end_s}")
    print()
    print("Peak candidates per row (GiB) and breakdown of the winning one:")
    for rid, mode, B, mpeak, mend, _line in ROWS:
        st, st_parts, cands, where = predict(c, mode, LORA, B, S)
        cs = ", ".join(f"{k}={v[0] / GiB:.3f}" for k, v in cands.items())
        print(f"  {rid}: measured {mpeak / GiB:.3f} | {cs}")
        print("      steady: " + ", ".join(f"{k}={v / GiB:.4f}" for k, v in st_parts.items()))
        print("      " + where + ": " + ", ".join(f"{k}={v / GiB:.4f}" for k, v in cands[where][1].items()))
    # A4 - A3 check from the reference notes
    pa3 = predict(c, "lora", LORA, 4, S)
    pa4 = predict(c, "lora", LORA, 8, S)
    d_pred = pa4[2][pa4[3]][0] - pa3[2][pa3[3]][0]
    print(f"\nA4 - A3: predicted {d_pred / GiB:.3f} GiB, measured {(38_742_912_512 - 26_704_571_904) / GiB:.3f} GiB"
          f" (= {d_pred / (4 * S):,.0f} B per extra token; logits part {(logits_bytes(c, 8, S) - logits_bytes(c, 4, S)) / (4 * S):,.0f} B)")


if __name__ == "__main__":
    main()
