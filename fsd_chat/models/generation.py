"""A GGUF file's generation defaults (`FileGeneration`): its sampling keys and the ids that end a
reply. The llama.cpp engine reads them as they are; the transformers engine's conversion writes them
into its copy's `GenerationConfig` (`FileGeneration.as_dict`, in `fsd_chat.models.gguf_files`), the
one place transformers' type is made of them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}
"""general.sampling.* keys (llama.cpp's gguf constants) -> the generation config fields they set."""


@dataclass(frozen=True, slots=True)
class FileGeneration:
    """A GGUF file's generation defaults, under transformers' `GenerationConfig` field names (which
    `fsd_chat.decoding.settings.SamplingRequest.resolve` reads).

    Attributes:
        bos_token_id: The beginning-of-sequence id (None: none).
        eos_token_id: The ids that end a reply (`end_of_turn_ids`): one as an int, several as a
            sorted list, None for none.
        pad_token_id: The padding id (None: none).
        do_sample: The file asks for sampling (its general.sampling.temp > 0, or other keys of it).
        temperature, top_k, top_p, min_p: The file's general.sampling.* values (None: not given).
    """

    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def as_dict(self) -> dict[str, object]:
        """The fields given (sampling fields only when sampling), for a `GenerationConfig`."""
        fields = {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "do_sample": self.do_sample,
        }
        sampling = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }
        return fields | {key: value for key, value in sampling.items() if value is not None}


def file_generation(
    metadata: Mapping[str, object], *, bos: int | None, eos: Iterable[int], pad: int | None
) -> FileGeneration:
    """The generation defaults of a GGUF file (its `metadata`): the general.sampling.* keys, which
    turn sampling on (a file without them, or with temp <= 0, decodes greedily: llama.cpp samples
    greedily at temperature <= 0), and `eos`, the ids that end a reply (llama.cpp's
    end-of-generation ids, or `end_of_turn_ids`): one as an int (as transformers writes it), several
    sorted, None for none."""
    sampling = {
        field: metadata[f"general.sampling.{key}"]
        for key, field in SAMPLING_KEYS.items()
        if f"general.sampling.{key}" in metadata
    }
    if float(sampling.get("temperature", 1.0)) <= 0:  # type: ignore[arg-type]
        sampling = {}
    ends = sorted(set(eos))
    return FileGeneration(
        bos_token_id=bos,
        eos_token_id=None if not ends else ends[0] if len(ends) == 1 else ends,
        pad_token_id=pad,
        do_sample=bool(sampling),
        **sampling,  # type: ignore[arg-type]
    )


END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
"""Tokens that end a turn wherever a vocabulary holds them: llama.cpp's list (llama-vocab.cpp, its
end-of-generation tokens found by text). A GGUF file names one end-of-sequence token, often not the
one its chat template ends a turn with: gemma-3-270m-it's names `<eos>`, while its replies end
with `<end_of_turn>` (its generation_config.json lists both; the file cannot)."""


def end_of_turn_ids(
    eos: int | list[int] | None, metadata: Mapping[str, object], vocabulary: Mapping[str, int]
) -> set[int]:
    """The ids that end a reply of a GGUF model, as llama.cpp ends one (`llama_vocab_is_eog`, which
    the llama.cpp engine asks itself), for the transformers engine's conversion: `eos` (the file's
    end-of-sequence id), the file's end-of-turn and end-of-message ids (tokenizer.ggml.eot_token_id,
    eom_token_id), and every `END_OF_TURN_TOKENS` token its `vocabulary` holds."""
    ids = {eos} if isinstance(eos, int) else set(eos or ())
    ids |= {
        v for key in ("eot", "eom") if isinstance(v := metadata.get(f"tokenizer.ggml.{key}_token_id"), int)
    }
    ids |= {vocabulary[token] for token in END_OF_TURN_TOKENS if token in vocabulary}
    return ids
