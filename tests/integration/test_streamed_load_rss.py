"""Peak memory of loading, measured in a fresh process (VmHWM from /proc/self/status) on a
random-weight checkpoint of ~300 MB written here: a bf16 safetensors folder and the same
weights as a BF16 GGUF. Loading is streamed into the serving dtype, so the peak stays within
the weights plus a bounded overhead; the float32-then-cast loader this replaced peaked at the
bf16 weights three times over (measured: 899 MiB above the interpreter for 297 MiB of bf16
weights), which the tight bound below fails. Measured now on the avx512_bf16 kind: 484 MiB (the
folder) and 441 MiB (the GGUF, whose one-off conversion runs in a child process: in-process it
left ~160 MiB behind and this bound failed by 25-40 MiB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import write_tokenizer_stub

pytestmark = pytest.mark.slow

# a Llama with untied head: 8 layers of 1024 / 2816, 16 heads, 4 KV heads, 32k vocabulary
SIZES = dict(h=1024, it=2816, layers=8, heads=16, kv=4, vocab=32000)
MiB = 1 << 20

CHILD = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from radixserve import LLM, SamplingParams
base = status("VmRSS")
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], num_pages=64, page_size=16, max_model_len=256,
          seed=0)
runner = llm.engine.runner
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}],
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(json.dumps({"base": base, "hwm": status("VmHWM"), "kv": sum(t.nbytes for t in runner.kv.layers),
                  "tokens": list(out[0].outputs[0].token_ids)}))
"""


def _weights() -> dict[str, torch.Tensor]:
    s = SIZES
    d = s["h"] // s["heads"]
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).bfloat16()

    def ones() -> torch.Tensor:
        return torch.ones(s["h"], dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": r(s["vocab"], s["h"]),
         "lm_head.weight": r(s["vocab"], s["h"]), "model.norm.weight": ones()}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": r(s["h"], s["h"]),
              p + "self_attn.k_proj.weight": r(s["kv"] * d, s["h"]),
              p + "self_attn.v_proj.weight": r(s["kv"] * d, s["h"]),
              p + "self_attn.o_proj.weight": r(s["h"], s["h"]),
              p + "mlp.gate_proj.weight": r(s["it"], s["h"]),
              p + "mlp.up_proj.weight": r(s["it"], s["h"]),
              p + "mlp.down_proj.weight": r(s["h"], s["it"]),
              p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones()}
    return t


def _write_folder(folder: Path, t: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    s = SIZES
    folder.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "vocab_size": s["vocab"], "hidden_size": s["h"], "intermediate_size": s["it"],
           "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv"], "rms_norm_eps": 1e-5,
           "max_position_embeddings": 2048, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
           "eos_token_id": 1, "bos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(t)
    index = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: t[k] for k in part}, str(folder / file))
        index |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    write_tokenizer_stub(str(folder))


def _write_gguf(path: Path, t: dict[str, torch.Tensor]) -> None:
    """The same bf16 values as a BF16 GGUF, laid out as llama.cpp's converter does (q/k rows
    permuted for its RoPE)."""
    import gguf

    from radixserve.frontend.tokenizer import bytes_to_unicode

    s = SIZES
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["layers"])
    w.add_context_length(2048)
    w.add_embedding_length(s["h"])
    w.add_feed_forward_length(s["it"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["h"] // s["heads"])
    table = bytes_to_unicode()
    tokens = ["<s>", "</s>"] + [table[b] for b in range(256)] + ["Ġt", "he"]
    pad = s["vocab"] - len(tokens)  # llama.cpp takes the vocabulary size from the token list
    tokens += [f"[PAD{i}]" for i in range(pad)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * 258 + [5] * pad)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, s["layers"])
    for name, tensor in t.items():
        base, suffix = name.rsplit(".", 1)
        a = tensor.float().numpy()
        heads = (s["heads"] if name.endswith("q_proj.weight")
                 else s["kv"] if name.endswith("k_proj.weight") else None)
        if heads is not None:
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, a.shape[1]).swapaxes(1, 2)
            a = a.reshape(tensor.shape)
        data = gguf.quants.quantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.BF16)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", data,
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _start(model: Path, dtype: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "RADIXSERVE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(model), dtype], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_peak_memory_of_loading_stays_near_the_weights(tmp_path, seed_kernel_cache):
    t = _weights()
    weight_bytes = sum(x.nbytes for x in t.values())  # bf16: the serving weights
    assert 280 * MiB < weight_bytes < 320 * MiB
    folder = tmp_path / "m"
    _write_folder(folder, t)
    gguf_file = tmp_path / "m-bf16.gguf"
    _write_gguf(gguf_file, t)
    del t
    # a fresh cache (no earlier conversion or measurement) but for the C kernel builds, which
    # the children would otherwise compile first; VmHWM is per process, so the two loads run
    # at once
    seed_kernel_cache(tmp_path / "cache")
    procs = {"folder": _start(folder, "bfloat16", tmp_path / "cache"),
             "gguf": _start(gguf_file, "bfloat16", tmp_path / "cache")}
    try:
        runs = {kind: _result(p) for kind, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    for kind, r in runs.items():
        # the bound: the serving weights + the KV pool + 1 GiB, the interpreter's
        # own ~220 MiB (torch and the server's imports) included
        assert r["hwm"] <= weight_bytes + r["kv"] + 1024 * MiB, (kind, r)
        # and what the load itself added: within 10% of the weights + 256 MiB (kernels,
        # oneDNN packing of one layer, a read block)
        assert r["hwm"] - r["base"] <= 1.1 * weight_bytes + r["kv"] + 256 * MiB, (kind, r)
    print({k: {f: (v // MiB if f != "tokens" else v) for f, v in r.items()} for k, r in runs.items()})
    # the same bf16 values from either file: the same greedy tokens
    assert runs["folder"]["tokens"] == runs["gguf"]["tokens"]
