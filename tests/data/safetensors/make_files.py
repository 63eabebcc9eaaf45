#!/usr/bin/env python3
"""Generates the safetensors fixtures for tests/test_safetensors.cpp (standard library only).

Good files follow the format in huggingface/safetensors README "Format": u64 little-endian header
length, compact JSON header padded with spaces to a multiple of 8, then the data buffer. Bad
files each break exactly one rule that safetensors/src/tensor.rs validates.
Run from anywhere: python3 tests/data/safetensors/make_files.py
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def header_bytes(header, pad=True):
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return text


def write(name, header, data, pad=True, raw_header=None):
    h = raw_header if raw_header is not None else header_bytes(header, pad)
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def f32(*vals):
    return struct.pack("<%df" % len(vals), *vals)


def main():
    # A PEFT adapter: __metadata__ {"format": "pt"}, lora_A [2,4] and lora_B [4,2] in F32.
    a = [0.5 * i for i in range(8)]        # 0, 0.5, ..., 3.5
    b = [-1.0 * i for i in range(8)]       # 0, -1, ..., -7
    write("adapter_model.safetensors",
          {"__metadata__": {"format": "pt"},
           LORA_A: {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
           LORA_B: {"dtype": "F32", "shape": [4, 2], "data_offsets": [32, 64]}},
          f32(*a) + f32(*b))

    # Mixed dtypes, a scalar and an empty tensor. F16 [1, -2, 0.5, 65504] = 3C00 C000 3800 7BFF;
    # BF16 [1, -2, 3.140625] = 3F80 C000 4049; I64 [7, -1].
    f16 = struct.pack("<4H", 0x3C00, 0xC000, 0x3800, 0x7BFF)
    bf16 = struct.pack("<3H", 0x3F80, 0xC000, 0x4049)
    i64 = struct.pack("<2q", 7, -1)
    scalar = f32(2.5)
    write("mixed_dtypes.safetensors",
          {"half": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]},
           "brain": {"dtype": "BF16", "shape": [3], "data_offsets": [8, 14]},
           "empty": {"dtype": "F32", "shape": [0, 3], "data_offsets": [14, 14]},
           "ids": {"dtype": "I64", "shape": [2], "data_offsets": [14, 30]},
           "scalar": {"dtype": "F32", "shape": [], "data_offsets": [30, 34]}},
          f16 + bf16 + i64 + scalar)

    one = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    with open(os.path.join(HERE, "bad_short.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00")
    with open(os.path.join(HERE, "bad_header_length.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 4096) + header_bytes(one) + f32(1, 2))
    write("bad_not_json.safetensors", None, f32(1, 2), raw_header=b'{"t": {"dtype": "F32",    ')
    write("bad_not_object.safetensors", None, b"", raw_header=b"[1, 2, 3]       ")
    write("bad_dtype.safetensors",
          {"t": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, f32(1, 2))
    write("bad_offsets_outside.safetensors",
          {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, f32(1, 2))
    write("bad_end_before_begin.safetensors",
          {"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, f32(1, 2))
    write("bad_overlap.safetensors",
          {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, f32(1, 2, 3))
    write("bad_gap.safetensors",
          {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, f32(1, 2, 3))
    write("bad_trailing_bytes.safetensors",
          {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, f32(1, 2, 3))
    write("bad_size_mismatch.safetensors",
          {"__metadata__": {"format": "pt"},
           LORA_A: {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 1024]}},
          bytes(1024))
    write("bad_duplicate.safetensors", None, f32(1, 2, 3, 4),
          raw_header=(b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                      b'"t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'))
    write("bad_metadata.safetensors",
          {"__metadata__": {"format": 1},
           "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, f32(1, 2))
    write("bad_negative_shape.safetensors",
          {"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, f32(1, 2))


if __name__ == "__main__":
    main()
