"""squishlike's own at-rest format, the npy-dir.

    OUT/manifest.json                    format, version, source, runtime dtype, cache policy, one entry per tensor
    OUT/tensors/pack-NNNNN.safetensors   the parts of one block of tensors, at the offsets the manifest records
                                         (format 1, still read: OUT/tensors/{key}__{suffix}.npy, one per part)

The manifest is keyed by canonical tensor name; `key` is a reversible, filesystem-safe encoding of that name.
Each scheme stores a fixed set of parts (squishlike/quant/schemes.py), and every part has a dtype and shape that
follow from the tensor's shape, so a reader can reject a file that does not fit its role before using it.

The format is read and written here only, as a pair: manifest.py is the typed manifest and its validation;
packs.py is how format 2 lays parts out in packs; reader.py opens a store and reads its parts (NpyDir), and says
whether a path is one (is_npydir, which every caller asks); writer.py writes a store's packs and its manifest
(NpyDirWriter), with checkpoints a killed compress resumes from.
"""

from ..quant.schemes import SCHEMES, Part, Role, Scheme
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TENSORS,
    ErrorStats,
    FileRecord,
    Manifest,
    Policy,
    Source,
    TensorEntry,
    bits_per_weight,
    decode_key,
    encode_key,
    part_file,
    source_fingerprint,
)
from .reader import TOKENIZER_FACTS, UNRECORDED, NpyDir, check_finite, is_npydir, read_source
from .writer import NpyDirWriter

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "source_fingerprint",
    "TENSORS",
    "TOKENIZER_FACTS",
    "UNRECORDED",
    "SCHEMES",
    "ErrorStats",
    "FileRecord",
    "Manifest",
    "NpyDir",
    "NpyDirWriter",
    "Part",
    "Policy",
    "Role",
    "Scheme",
    "Source",
    "TensorEntry",
    "bits_per_weight",
    "check_finite",
    "decode_key",
    "encode_key",
    "is_npydir",
    "part_file",
    "read_source",
]
