"""Write llama.cpp's per-token logprobs of a fixed text on a GGUF file, as a golden file for
``tests/integration/test_quantized_default.py`` (the suite does not build llama.cpp: it takes
minutes, and llama-cpp-python 0.3.36 as built by default crashes on the AMX kind).

Run with the peers' venv, which has llama-cpp-python (``make bench-peers``)::

    .venv-peers/bin/python benchmarks/golden/llama_cpp_logprobs.py TOKENS.json MODEL.gguf OUT.json

TOKENS.json holds ``{"token_ids": [...]}``: the text already tokenized by radixserve's own
tokenizer (``--dump-tokens`` below writes it), so both engines score the same ids. The output
names the llama.cpp version, the file's size and sha256, the ids and the logprob of each id
given the ones before it (the first has none), from one evaluation with ``logits_all=True``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    tokens_path, model_path, out_path = (Path(a) for a in sys.argv[1:4])
    import llama_cpp

    ids = json.loads(tokens_path.read_text())["token_ids"]
    llm = llama_cpp.Llama(str(model_path), n_ctx=len(ids) + 16, n_batch=512, n_threads=2,
                          logits_all=True, verbose=False)
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[:len(ids)], dtype=np.float64)
    m = logits.max(axis=1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    # position i's logits predict token i + 1
    lps = [float(logits[i, ids[i + 1]] - logz[i]) for i in range(len(ids) - 1)]
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    out = {"llama_cpp_python": llama_cpp.__version__, "model_file": model_path.name,
           "model_bytes": model_path.stat().st_size, "model_sha256": digest,
           "token_ids": ids, "logprobs": lps,
           "perplexity": float(np.exp(-np.mean(lps)))}
    out_path.write_text(json.dumps(out))
    print(f"{model_path.name}: {len(ids)} tokens, perplexity {out['perplexity']:.4f} "
          f"(llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    main()
