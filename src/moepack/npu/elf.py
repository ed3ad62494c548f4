"""Just enough ELF to pull a named section (the runtime's ``.ctrltext``) out of a file.

32- and 64-bit, either byte order; every offset is checked against the file size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import BadInput

MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    size: int
    type: int


def is_elf(data: bytes) -> bool:
    return data[:4] == MAGIC


def sections(data: bytes, path: str = "") -> list[Section]:
    if len(data) < 52 or not is_elf(data):
        raise BadInput("not an ELF file", path)
    cls, enc = data[4], data[5]
    if cls not in (1, 2) or enc not in (1, 2):
        raise BadInput(f"unsupported ELF class {cls} / encoding {enc}", path)
    e = "<" if enc == 1 else ">"
    if cls == 2:
        if len(data) < 64:
            raise BadInput("ELF header is truncated", path)
        (shoff,) = struct.unpack_from(e + "Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from(e + "HHH", data, 0x3A)
        fmt, want = e + "IIQQQQIIQQ", 64
    else:
        (shoff,) = struct.unpack_from(e + "I", data, 0x20)
        shentsize, shnum, shstrndx = struct.unpack_from(e + "HHH", data, 0x2E)
        fmt, want = e + "IIIIIIIIII", 40
    if shnum == 0:
        return []
    if shentsize < want or shoff + shnum * shentsize > len(data):
        raise BadInput(f"section headers at {shoff:#x} run past the end of the file", path)
    raw = []
    for i in range(shnum):
        f = struct.unpack_from(fmt, data, shoff + i * shentsize)
        name, typ = f[0], f[1]
        off, size = (f[4], f[5]) if cls == 2 else (f[4], f[5])
        raw.append((name, typ, off, size))
    if shstrndx >= shnum:
        raise BadInput(f"section-name table index {shstrndx} is out of range", path)
    _, _, soff, ssize = raw[shstrndx]
    if soff + ssize > len(data):
        raise BadInput("section-name table runs past the end of the file", path)
    strtab = data[soff : soff + ssize]
    out = []
    for name, typ, off, size in raw:
        end = strtab.find(b"\0", name)
        label = strtab[name : end if end >= 0 else len(strtab)].decode("latin-1")
        if typ != 8 and off + size > len(data):  # 8 = SHT_NOBITS
            raise BadInput(
                f"section {label!r} [{off:#x}, +{size:#x}) runs past the end of the file", path
            )
        out.append(Section(label, off, size, typ))
    return out


def section_bytes(data: bytes, name: str, path: str = "") -> bytes:
    for s in sections(data, path):
        if s.name == name:
            return data[s.offset : s.offset + s.size]
    raise BadInput(f"ELF file has no {name!r} section", path)


def build_elf(named: dict[str, bytes]) -> bytes:
    """A minimal little-endian ELF64 holding the given sections (for tests and fixtures)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in named) + b".shstrtab\0"
    body = bytearray(64)
    offs = []
    for blob in named.values():
        offs.append(len(body))
        body += blob
        body += b"\0" * (-len(body) % 8)
    str_off = len(body)
    body += names
    body += b"\0" * (-len(body) % 8)
    shoff = len(body)
    headers = [bytes(64)]
    at = 1
    for (n, blob), off in zip(named.items(), offs, strict=True):
        headers.append(struct.pack("<IIQQQQIIQQ", at, 1, 0, 0, off, len(blob), 0, 0, 4, 0))
        at += len(n) + 1
    headers.append(struct.pack("<IIQQQQIIQQ", at, 3, 0, 0, str_off, len(names), 0, 0, 1, 0))
    body += b"".join(headers)
    ident = MAGIC + bytes([2, 1, 1]) + bytes(9)
    hdr = ident + struct.pack(
        "<HHIQQQIHHHHHH", 1, 0, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), len(headers) - 1
    )
    body[:64] = hdr
    return bytes(body)
