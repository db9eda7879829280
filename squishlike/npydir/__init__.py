"""squishlike's own at-rest format, the npy-dir.

    OUT/manifest.json                   format, version, source, runtime dtype, cache policy, one entry per tensor
    OUT/tensors/{key}__{suffix}.npy     one file per part of each tensor

The manifest is keyed by canonical tensor name; `key` is a reversible, filesystem-safe encoding of that name.
Each scheme stores a fixed set of parts (squishlike/quant/schemes.py), and every part has a dtype and shape that
follow from the tensor's shape, so a reader can reject a file that does not fit its role before using it.

The format is read and written here only, as a pair: manifest.py is the typed manifest and its validation;
reader.py opens a store and reads its parts (NpyDir), and says whether a path is one (is_npydir, which every
caller asks); writer.py writes a store's parts and its manifest (NpyDirWriter).
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
    decode_key,
    encode_key,
    part_file,
)
from .reader import TOKENIZER_FACTS, UNRECORDED, NpyDir, is_npydir, read_source
from .writer import NpyDirWriter

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
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
    "decode_key",
    "encode_key",
    "is_npydir",
    "part_file",
    "read_source",
]
