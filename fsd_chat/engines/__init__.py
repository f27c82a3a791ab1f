"""Engines other than transformers / torch, each behind the decoding loop's one seam
(`fsd_chat.decoding.runner.ModelRunner`).

- `llama_cpp`: GGUF files run natively quantized on llama.cpp through llama-cpp-python, an
  optional dependency imported only when the engine is used.

The transformers / torch engine is `fsd_chat.decoding.kv_cache` (its static and compiled caches and
the whole-step CUDA graphs of `fsd_chat.decoding.step_graph` are its own).
"""
