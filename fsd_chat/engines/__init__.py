"""The engines, each behind the decoding loop's one seam
(`fsd_chat.decoding.runner.ModelRunner`).

- `llama_cpp`: GGUF files run natively quantized on llama.cpp through llama-cpp-python, an
  optional dependency imported only when the engine is used.
- `torch_engine`: transformers models in torch: their runners (`kv_cache.CachedModel` and its
  static and compiled kinds), the whole step over them (`step_graph`, a `WholeStep`: eager on the
  CPU, CUDA graphs on CUDA), the decoders built over them (`binding`) and their forward times
  (`timings`).
"""
