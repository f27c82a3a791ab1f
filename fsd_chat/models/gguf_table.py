"""A GGUF file's header, metadata and tensor table, read once per start; which ggml types its tensors
hold and which of them can be dequantized; and its identity, the key of its converted copy.

Neither reader at hand does this part: transformers' (`GgufHeader.from_file`) refuses a tensor
table holding any type its own dequantizer lacks (Q5_0, Q5_1, TQ1_0, TQ2_0, MXFP4, NVFP4), calling a
good file "damaged or truncated", and the `gguf` package's (`GGUFReader`) refuses a type id it does
not know and builds an array per tensor (2 s for a 135M model). This one reads the layout only
(llama.cpp's gguf.h: the magic, version, counts, key/value pairs, then one entry per tensor, then
the aligned tensor data), so that every refusal names what it refuses.

Dequantization itself is the `gguf` package's (`gguf.quants.dequantize`, the values llama.cpp's
own dequantizer computes): it reads every type its `GGMLQuantizationType` names except a few that
hold no model weights (Q8_1, Q8_K: llama.cpp's matmul intermediates) or no floats (I8..I64),
and F64 and Q1_0.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from math import prod
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
from gguf.quants import dequantize

from fsd_chat.support.text import some

MAGIC = b"GGUF"
VERSIONS = (2, 3)
"""GGUF versions with 64-bit counts: llama.cpp has written v3 since 2023; v1 (32-bit counts) is gone."""
DEFAULT_ALIGNMENT = 32
"""Where the data section and each tensor start when `general.alignment` is absent (gguf.h)."""
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
"""GGUF metadata value types of fixed width -> their struct format (8 is a string, 9 an array)."""
_STRING, _ARRAY = 8, 9
SAMPLES = 16
"""How many spread chunks of the tensor data go into a file's identity, besides its whole header."""
SAMPLE_BYTES = 1 << 16
"""The size of each sampled chunk (64 KiB: 1 MiB read per start in all, whatever the file's size)."""


class TensorEntry(NamedTuple):
    """One tensor of the table: where it lives and how it is stored."""

    name: str
    shape: tuple[int, ...]
    """In torch's order (outermost first; the file lists ggml's, innermost first)."""
    type_id: int
    """Its ggml type (`gguf.GGMLQuantizationType`), possibly one the gguf package does not know."""
    offset: int
    """Bytes from the start of the data section."""

    @property
    def nbytes(self) -> int:
        """Its size in the file, in bytes (for a type `gguf.GGML_QUANT_SIZES` sizes)."""
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.type_id)]
        return prod(self.shape) // block * size


@dataclass(frozen=True)
class TensorTable:
    """A GGUF file's metadata and tensor table (`read_table`), none of its tensor data."""

    path: Path
    metadata: dict[str, object]
    """Its key/value pairs: numbers, strings, lists of numbers; a list of strings as its length
    (vocabularies and merges are the tokenizer's business, and the bulk of a header)."""
    tensors: tuple[TensorEntry, ...]
    table_start: int
    """Where the tensor table starts, in bytes from the file's start (after the key/value pairs)."""
    data_start: int
    """Where the tensor data starts (the table's end, aligned)."""
    alignment: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, entry: TensorEntry) -> np.ndarray:
        """`entry`'s bytes as stored, read-only: (rows, bytes a row) for a block type, else flat."""
        data = np.memmap(self.path, mode="r", dtype=np.uint8, offset=self.data_start + entry.offset)
        return data[: entry.nbytes]

    def values(self, entry: TensorEntry) -> np.ndarray:
        """`entry` dequantized by the gguf package: a new float32 array, in `entry.shape`."""
        qtype = gguf.GGMLQuantizationType(entry.type_id)
        # Copied where the gguf package hands back a view of the read-only map (F32).
        return np.require(dequantize(self.raw(entry), qtype).reshape(entry.shape), requirements="W")


def read_table(path: Path) -> TensorTable:
    """The metadata and tensor table of the GGUF file `path`.

    Raises:
        ValueError: it does not start with the GGUF magic, has another version, or holds a
            metadata value of no GGUF type.
        struct.error: it ends inside its header or table.
        UnicodeDecodeError: a key or string is not UTF-8.
        OSError: it cannot be read.
    """
    with path.open("rb") as file:
        if path.stat().st_size < len(MAGIC) or file.read(len(MAGIC)) != MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes, so it is not a GGUF file")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse(path, blob)


def _parse(path: Path, blob: mmap.mmap) -> TensorTable:
    version, tensor_count, key_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in VERSIONS:
        raise ValueError(
            f"it is GGUF version {version}; fsd-chat reads versions {VERSIONS[0]} and {VERSIONS[1]}"
        )
    pos = 24
    metadata: dict[str, object] = {}
    for _ in range(key_count):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind)
    table_start = pos
    tensors = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        tensors.append(TensorEntry(name, tuple(reversed(shape)), type_id, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"its general.alignment {alignment!r} is not a power of two")
    return TensorTable(path, metadata, tuple(tensors), table_start, _aligned(pos, alignment), alignment)


def _aligned(pos: int, alignment: int) -> int:
    return (pos + alignment - 1) // alignment * alignment


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + length
    if end > len(blob):
        raise struct.error(f"a string runs past the end of the file (at byte {pos})")
    return blob[pos + 8 : end].decode("utf-8"), end


def _value(blob: mmap.mmap, pos: int, kind: int) -> tuple[object, int]:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"it holds a metadata value of type {kind}, which GGUF does not define")
    element, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element in _SCALARS:
        fmt = _SCALARS[element]
        width = struct.calcsize(fmt)
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * width
    if element != _STRING:
        raise ValueError(f"it holds a metadata array of type {element}, which fsd-chat cannot read")
    for _ in range(count):  # walked, not decoded: see TensorTable.metadata
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return count, pos


def identity(table: TensorTable, salt: str) -> str:
    """A hex key for the file's content, whatever its path or modification time: a hash of `salt`,
    its size, its whole header (metadata and tensor table) and `SAMPLES` chunks of `SAMPLE_BYTES`
    spread evenly through its tensor data. Two files with the same key hold the same model: the
    header names each tensor's type, shape and place, and a model with other weights differs in
    every chunk (a retrained or requantized one, even of the same layout)."""
    digest = hashlib.sha256(salt.encode())
    with table.path.open("rb") as file:
        size = file.seek(0, 2)
        digest.update(f"\0{size}\0".encode())
        file.seek(0)
        digest.update(file.read(table.data_start))
        span = max(size - table.data_start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES):
            file.seek(table.data_start + span * i // max(SAMPLES - 1, 1))
            digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()[:20]


FLOATS = frozenset(
    {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
)
"""The types that hold values rather than blocks."""


@cache
def dequantizable() -> frozenset[int]:
    """The ggml type ids `gguf.quants.dequantize` reads, found by asking it to read one block of
    each (its registry is private; a type it lacks raises NotImplementedError)."""
    readable = set()
    for qtype in gguf.GGMLQuantizationType:
        block = np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], dtype=np.uint8)
        try:
            dequantize(block, qtype)
        except NotImplementedError:
            continue
        readable.add(int(qtype))
    return frozenset(readable)


def type_name(type_id: int) -> str:
    """`Q5_0 (id 6)`; `an unknown type (id 99)` for an id the gguf package does not know."""
    try:
        return f"{gguf.GGMLQuantizationType(type_id).name} (id {type_id})"
    except ValueError:
        return f"an unknown type (id {type_id})"


def type_names(type_ids: Iterable[int]) -> str:
    """The types' names in id order, for messages: `F32, F16, Q4_0, …`."""
    return ", ".join(gguf.GGMLQuantizationType(t).name for t in sorted(type_ids))


def holders(table: TensorTable, type_ids: Iterable[int]) -> str:
    """Each type of `type_ids` that `table` holds, with the tensors that hold it, for messages:
    `Q1_0 (id 41) in 2 tensors (blk.0.attn_q.weight, blk.0.attn_k.weight)`."""
    by_type: dict[int, list[str]] = {}
    for entry in table.tensors:
        if entry.type_id in type_ids:
            by_type.setdefault(entry.type_id, []).append(entry.name)
    return "; ".join(
        f"{type_name(t)} in {len(names)} tensor{'s' * (len(names) != 1)} ({some(names)})"
        for t, names in sorted(by_type.items())
    )


def with_values(table: TensorTable, type_ids: frozenset[int], path: Path) -> Path:
    """Write a copy of the file at `path` in which every tensor of a type in `type_ids` is stored as
    F32, its values `TensorTable.values`' (gguf.quants.dequantize's): the same model, for a reader
    that lacks those types. The header up to the tensor table is copied byte for byte (the same
    metadata, tensor count and alignment), the other tensors' bytes as they are.

    Returns:
        `path`.
    """
    f32 = int(gguf.GGMLQuantizationType.F32)
    stored = [entry._replace(type_id=f32) if entry.type_id in type_ids else entry for entry in table.tensors]
    offsets, end = [], 0
    for entry in stored:
        offsets.append(end)
        end = _aligned(end + entry.nbytes, table.alignment)
    with table.path.open("rb") as source, path.open("wb") as out:
        out.write(source.read(table.table_start))
        for entry, offset in zip(stored, offsets, strict=True):
            name = entry.name.encode()
            out.write(struct.pack("<Q", len(name)) + name)
            out.write(struct.pack(f"<I{len(entry.shape)}Q", len(entry.shape), *reversed(entry.shape)))
            out.write(struct.pack("<IQ", entry.type_id, offset))
        data_start = _aligned(out.tell(), table.alignment)
        for original, entry, offset in zip(table.tensors, stored, offsets, strict=True):
            out.write(b"\0" * (data_start + offset - out.tell()))
            data = table.values(original) if entry is not original else table.raw(original)
            out.write(np.ascontiguousarray(data).data)  # its buffer: no second copy of a large tensor
    return path
