"""Byte mutations for the preprocessing fuzzer: generic ones plus structure-aware JPEG, PNG and
video ones.

Every mutator is ``(data, rng) -> bytes``, pure and deterministic for a given ``random.Random``
state, and never raises on malformed input (a structure mutator that finds no structure returns
the input unchanged). Standard library only, so the fuzzer's guard process stays light; the video
mutators import PyAV (to find the packets) when they run, in the fuzzing process.
"""

from __future__ import annotations

import io
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

Mutator = Callable[[bytes, random.Random], bytes]

JPEG_SOI = b"\xff\xd8"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Frame headers (SOF0..SOF15 except DHT, JPG and DAC).
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
STANDALONE_MARKERS = frozenset(range(0xD0, 0xD8)) | {0x01}
INTERESTING_SIZES = (0, 1, 2, 7, 8, 9, 15, 16, 17, 27, 28, 29, 255, 256, 1023, 1792, 1793, 2001, 7168, 7169, 65535)
SAMPLING_FACTORS = (0x00, 0x11, 0x12, 0x21, 0x22, 0x13, 0x31, 0x14, 0x41, 0x24, 0x42, 0x44, 0x33, 0x55)
# (bit depth, colour type), valid and invalid.
PNG_FORMATS = ((8, 0), (8, 2), (8, 3), (8, 4), (8, 6), (16, 0), (16, 2), (16, 6), (1, 0), (2, 3), (4, 0), (3, 2))


# -- generic ----------------------------------------------------------------------------------


def cut(data: bytes, rng: random.Random) -> bytes:
    """Truncate at a random point (keeps at least one byte)."""
    return data[: rng.randrange(1, len(data))] if len(data) > 1 else data


def flip_bytes(data: bytes, rng: random.Random) -> bytes:
    """XOR 1-8 random bytes with a non-zero value."""
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        buf[rng.randrange(len(buf))] ^= rng.randint(1, 255)
    return bytes(buf)


def insert_random(data: bytes, rng: random.Random) -> bytes:
    """Insert 1-16 random bytes at a random offset."""
    pos = rng.randint(0, len(data))
    return data[:pos] + rng.randbytes(rng.randint(1, 16)) + data[pos:]


def delete_range(data: bytes, rng: random.Random) -> bytes:
    """Remove a random run of up to 64 bytes."""
    if len(data) < 2:
        return data
    start = rng.randrange(len(data) - 1)
    return data[:start] + data[start + rng.randint(1, min(64, len(data) - start - 1)) :]


def duplicate_range(data: bytes, rng: random.Random) -> bytes:
    """Copy a random run of up to 256 bytes right after itself."""
    if not data:
        return data
    start = rng.randrange(len(data))
    end = min(len(data), start + rng.randint(1, 256))
    return data[:end] + data[start:end] + data[end:]


def append_trailer(data: bytes, rng: random.Random) -> bytes:
    """Append junk after the end of the image."""
    return data + rng.randbytes(rng.randint(1, 64))


# -- JPEG -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One marker segment ``data[start:end]`` (0xFF, the marker, and its length-prefixed body)."""

    start: int
    end: int
    marker: int


@dataclass(frozen=True)
class JpegLayout:
    segments: list[Segment]
    entropy: list[tuple[int, int]]  # [start, end) of each scan's entropy-coded data


def _entropy_end(data: bytes, pos: int) -> int:
    """Offset of the marker that ends the entropy-coded data starting at ``pos``."""
    while True:
        pos = data.find(b"\xff", pos)
        if pos < 0 or pos + 1 >= len(data):
            return len(data)
        code = data[pos + 1]
        if code == 0x00 or 0xD0 <= code <= 0xD7 or code == 0xFF:
            pos += 1 if code == 0xFF else 2
            continue
        return pos


def jpeg_layout(data: bytes) -> JpegLayout:
    """Marker segments and entropy ranges, as far as the stream is well formed."""
    segments: list[Segment] = []
    entropy: list[tuple[int, int]] = []
    if not data.startswith(JPEG_SOI):
        return JpegLayout(segments, entropy)
    pos = 2
    while pos + 2 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xD9 or marker in STANDALONE_MARKERS:
            segments.append(Segment(pos, pos + 2, marker))
            if marker == 0xD9:
                break
            pos += 2
            continue
        if pos + 4 > len(data):
            break
        end = pos + 2 + struct.unpack(">H", data[pos + 2 : pos + 4])[0]
        if end > len(data):
            break
        segments.append(Segment(pos, end, marker))
        pos = end
        if marker == 0xDA:
            pos = _entropy_end(data, end)
            entropy.append((end, pos))
    return JpegLayout(segments, entropy)


def _entropy_positions(data: bytes, rng: random.Random) -> list[int]:
    layout = jpeg_layout(data)
    ranges = [(start, end) for start, end in layout.entropy if end > start]
    if not ranges:
        return []
    start, end = rng.choice(ranges)
    return [rng.randrange(start, end) for _ in range(rng.randint(1, 8))]


def jpeg_flip_entropy_clean(data: bytes, rng: random.Random) -> bytes:
    """Replace bytes of entropy-coded data without creating or breaking a marker.

    The marker structure stays clean, so the stream still takes the fast decoder: this compares
    nvImageCodec's and Pillow's handling of corrupt Huffman data.
    """
    buf = bytearray(data)
    for pos in _entropy_positions(data, rng):
        if buf[pos] != 0xFF and buf[pos - 1] != 0xFF:
            buf[pos] = rng.randrange(0xFF)
    return bytes(buf)


def jpeg_flip_entropy_raw(data: bytes, rng: random.Random) -> bytes:
    """XOR bytes of entropy-coded data (may create markers or break byte stuffing)."""
    buf = bytearray(data)
    for pos in _entropy_positions(data, rng):
        buf[pos] ^= rng.randint(1, 255)
    return bytes(buf)


def jpeg_cut_entropy(data: bytes, rng: random.Random) -> bytes:
    """Truncate inside the entropy-coded data of a random scan."""
    positions = _entropy_positions(data, rng)
    return data[: positions[0]] if positions else cut(data, rng)


def jpeg_insert_marker(data: bytes, rng: random.Random) -> bytes:
    """Insert a marker (restart, EOI, SOS, APPn or an unknown one) inside entropy-coded data."""
    positions = _entropy_positions(data, rng)
    if not positions:
        return data
    marker = rng.choice((0xD0, 0xD3, 0xD7, 0xD9, 0xDA, 0xE1, 0xC4, 0x01, 0x02, 0xF0))
    return data[: positions[0]] + bytes((0xFF, marker)) + data[positions[0] :]


def _pick_segment(data: bytes, rng: random.Random) -> Segment | None:
    segments = jpeg_layout(data).segments
    return rng.choice(segments) if segments else None


def jpeg_duplicate_segment(data: bytes, rng: random.Random) -> bytes:
    """Repeat a marker segment (a second SOF, DHT, SOS header, APPn, ...) right after itself."""
    seg = _pick_segment(data, rng)
    return data if seg is None else data[: seg.end] + data[seg.start : seg.end] + data[seg.end :]


def jpeg_remove_segment(data: bytes, rng: random.Random) -> bytes:
    """Drop a marker segment (DQT, DHT, SOF, SOS header, DRI, EOI, ...)."""
    seg = _pick_segment(data, rng)
    return data if seg is None else data[: seg.start] + data[seg.end :]


def _sof(data: bytes) -> Segment | None:
    return next((s for s in jpeg_layout(data).segments if s.marker in SOF_MARKERS and s.end - s.start >= 10), None)


def jpeg_sof_size(data: bytes, rng: random.Random) -> bytes:
    """Rewrite the frame header's height and/or width (interesting values or the old one +-1)."""
    sof = _sof(data)
    if sof is None:
        return data
    height, width = struct.unpack(">HH", data[sof.start + 5 : sof.start + 9])

    def new(old: int) -> int:
        return rng.choice((rng.choice(INTERESTING_SIZES), max(0, old - 1), min(65535, old + 1), old))

    return data[: sof.start + 5] + struct.pack(">HH", new(height), new(width)) + data[sof.start + 9 :]


def jpeg_sof_sampling(data: bytes, rng: random.Random) -> bytes:
    """Change one component's sampling factors in the frame header."""
    sof = _sof(data)
    if sof is None:
        return data
    components = data[sof.start + 9]
    if components == 0 or sof.start + 10 + 3 * components > sof.end:
        return data
    pos = sof.start + 11 + 3 * rng.randrange(components)
    return data[:pos] + bytes((rng.choice(SAMPLING_FACTORS),)) + data[pos + 1 :]


# -- PNG --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One chunk ``data[start:end]``: length, type, body ``data[start+8:end-4]``, CRC."""

    start: int
    end: int
    kind: bytes


def png_chunks(data: bytes) -> list[Chunk]:
    """The chunks after the signature, as far as their lengths are consistent."""
    chunks: list[Chunk] = []
    if not data.startswith(PNG_SIGNATURE):
        return chunks
    pos = len(PNG_SIGNATURE)
    while pos + 12 <= len(data):
        end = pos + 12 + struct.unpack(">I", data[pos : pos + 4])[0]
        if end > len(data):
            break
        chunks.append(Chunk(pos, end, data[pos + 4 : pos + 8]))
        pos = end
    return chunks


def _replace_body(data: bytes, chunk: Chunk, body: bytes, fix_crc: bool) -> bytes:
    crc = struct.pack(">I", zlib.crc32(chunk.kind + body) & 0xFFFFFFFF) if fix_crc else data[chunk.end - 4 : chunk.end]
    encoded = struct.pack(">I", len(body)) + chunk.kind + body + crc
    return data[: chunk.start] + encoded + data[chunk.end :]


def _body(data: bytes, chunk: Chunk) -> bytes:
    return data[chunk.start + 8 : chunk.end - 4]


def _first(data: bytes, kind: bytes) -> Chunk | None:
    return next((c for c in png_chunks(data) if c.kind == kind), None)


def png_ihdr_size(data: bytes, rng: random.Random) -> bytes:
    """Rewrite IHDR's width and/or height (CRC fixed 9 times in 10)."""
    ihdr = _first(data, b"IHDR")
    if ihdr is None or ihdr.end - ihdr.start < 20:
        return data
    body = _body(data, ihdr)
    width, height = struct.unpack(">II", body[:8])
    sizes = (rng.choice(INTERESTING_SIZES), max(0, width - 1), width + 1, width, height)
    size = struct.pack(">II", rng.choice(sizes), rng.choice((*sizes, height)))
    return _replace_body(data, ihdr, size + body[8:], rng.random() < 0.9)


def png_ihdr_format(data: bytes, rng: random.Random) -> bytes:
    """Rewrite IHDR's bit depth, colour type or interlace flag (CRC fixed)."""
    ihdr = _first(data, b"IHDR")
    if ihdr is None or ihdr.end - ihdr.start < 25:
        return data
    body = bytearray(_body(data, ihdr))
    if rng.random() < 0.8:
        body[8], body[9] = rng.choice(PNG_FORMATS)
    else:
        body[12] ^= 1
    return _replace_body(data, ihdr, bytes(body), True)


def png_corrupt_crc(data: bytes, rng: random.Random) -> bytes:
    """Damage one chunk's CRC."""
    chunks = png_chunks(data)
    if not chunks:
        return data
    pos = rng.choice(chunks).end - rng.randint(1, 4)
    return data[:pos] + bytes((data[pos] ^ rng.randint(1, 255),)) + data[pos + 1 :]


def png_corrupt_idat(data: bytes, rng: random.Random) -> bytes:
    """Flip or truncate compressed pixel data in one IDAT (CRC fixed 9 times in 10)."""
    idats = [c for c in png_chunks(data) if c.kind == b"IDAT" and c.end - c.start > 12]
    if not idats:
        return data
    idat = rng.choice(idats)
    body = _body(data, idat)
    if rng.random() < 0.3:
        body = body[: rng.randrange(len(body))]
    else:
        body = flip_bytes(body, rng)
    return _replace_body(data, idat, body, rng.random() < 0.9)


def png_remove_chunk(data: bytes, rng: random.Random) -> bytes:
    """Drop a chunk (IHDR, PLTE, tRNS, an IDAT, IEND, ...)."""
    chunks = png_chunks(data)
    if not chunks:
        return data
    chunk = rng.choice(chunks)
    return data[: chunk.start] + data[chunk.end :]


def png_duplicate_chunk(data: bytes, rng: random.Random) -> bytes:
    """Repeat a chunk right after itself."""
    chunks = png_chunks(data)
    if not chunks:
        return data
    chunk = rng.choice(chunks)
    return data[: chunk.end] + data[chunk.start : chunk.end] + data[chunk.end :]


# -- videos -------------------------------------------------------------------------------------


def video_packets(data: bytes) -> list[tuple[int, int]]:
    """(file offset, size) of each packet of the first video stream, as PyAV's demuxer finds them."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            return [(p.pos, p.size) for p in container.demux(video=0) if p.size and p.pos is not None and p.pos >= 0]
    except (av.FFmpegError, ValueError, IndexError):
        return []


def video_garble_packet(data: bytes, rng: random.Random) -> bytes:
    """1-16 bytes inside one video packet XORed: damage where a picture's data lies."""
    packets = video_packets(data)
    if not packets:
        return data
    pos, size = rng.choice(packets)
    start = min(pos + rng.randrange(max(size, 1)), len(data) - 1)
    end = min(start + rng.randint(1, 16), pos + size, len(data))
    return data[:start] + bytes(b ^ rng.randrange(1, 256) for b in data[start:end]) + data[end:]


def video_zero_packet_tail(data: bytes, rng: random.Random) -> bytes:
    """One video packet's bytes zeroed from somewhere in it to its end (a picture cut short)."""
    packets = video_packets(data)
    if not packets:
        return data
    pos, size = rng.choice(packets)
    start = min(pos + rng.randrange(max(size, 1)), len(data))
    end = min(pos + size, len(data))
    return data[:start] + bytes(end - start) + data[end:]


def video_drop_packet(data: bytes, rng: random.Random) -> bytes:
    """One video packet's bytes removed (the container's index then points past its data)."""
    packets = video_packets(data)
    if not packets:
        return data
    pos, size = rng.choice(packets)
    return data[:pos] + data[pos + size :]


# -- dispatch ---------------------------------------------------------------------------------

GENERIC: dict[str, Mutator] = {
    f.__name__: f for f in (cut, flip_bytes, insert_random, delete_range, duplicate_range, append_trailer)
}
JPEG: dict[str, Mutator] = {
    f.__name__: f
    for f in (
        jpeg_flip_entropy_clean,
        jpeg_flip_entropy_raw,
        jpeg_cut_entropy,
        jpeg_insert_marker,
        jpeg_duplicate_segment,
        jpeg_remove_segment,
        jpeg_sof_size,
        jpeg_sof_sampling,
    )
}
PNG: dict[str, Mutator] = {
    f.__name__: f
    for f in (png_ihdr_size, png_ihdr_format, png_corrupt_crc, png_corrupt_idat, png_remove_chunk, png_duplicate_chunk)
}
ALL: dict[str, Mutator] = {**GENERIC, **JPEG, **PNG}


def mutators_for(data: bytes) -> dict[str, Mutator]:
    """The structure-aware mutators that fit ``data``'s format, or the generic ones."""
    if data.startswith(JPEG_SOI):
        return JPEG
    if data.startswith(PNG_SIGNATURE):
        return PNG
    return GENERIC


VIDEO: dict[str, Mutator] = {f.__name__: f for f in (video_garble_packet, video_zero_packet_tail, video_drop_packet)}


def mutate_video(data: bytes, rng: random.Random, max_size: int) -> bytes:
    """Apply 1-3 mutations to an encoded video, packet-aware two times in three; at most ``max_size`` bytes."""
    for _ in range(rng.randint(1, 3)):
        pool = VIDEO if rng.random() < 2 / 3 else GENERIC
        data = rng.choice(list(pool.values()))(data, rng)
    return data[:max_size]


def mutate(data: bytes, rng: random.Random, max_size: int) -> bytes:
    """Apply 1-3 mutations, structure-aware two times in three; at most ``max_size`` bytes."""
    for _ in range(rng.randint(1, 3)):
        pool = mutators_for(data) if rng.random() < 2 / 3 else GENERIC
        data = rng.choice(list(pool.values()))(data, rng)
    return data[:max_size]
