"""Whether a compressed frame is a reference frame, read from its packet's bytes.

A decoder told to skip non-reference frames (``skip_frame`` "NONREF") still outputs every frame
another frame may refer to; knowing which those are lets the sampled decode of :mod:`.video_decode` say
which frames must come out of the decoder, and notice when one does not (a damaged stream). Each
reader returns None where the bytes do not say (no picture header found): the video is then
decoded whole.

- H.264 (ITU-T H.264 7.3.1): the first slice NAL unit (types 1-5); reference when ``nal_ref_idc``
  is not 0. Length-prefixed NAL units when the stream's extradata is an ``avcC`` record (MP4,
  MKV), else Annex B start codes.
- HEVC (ITU-T H.265 7.4.2.2): the first slice NAL unit (types 0-31); the sub-layer non-reference
  types are the even ones below 16 (TRAIL_N, TSA_N, STSA_N, RADL_N, RASL_N, RSV_VCL_N10/12/14).
  Length-prefixed when the extradata is an ``hvcC`` record.
- MPEG-4 Part 2 (ISO/IEC 14496-2 6.2.5): ``vop_coding_type`` after the VOP start code 0x1B6;
  B-VOPs (2) are not references. A packet with two VOPs (packed B-frames) is not read.
- MPEG-2 (ISO/IEC 13818-2 6.2.3): ``picture_coding_type`` after the picture start code 0x100;
  B-pictures (3) are not references.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

START_CODE = b"\x00\x00\x01"


def nal_units(data: bytes, length_size: int | None) -> Iterator[bytes]:
    """The NAL units of one packet: ``length_size``-byte big-endian prefixes, or Annex B start codes (None)."""
    if length_size is None:
        yield from data.split(START_CODE)[1:]
        return
    pos = 0
    while pos + length_size <= len(data):
        size = int.from_bytes(data[pos : pos + length_size], "big")
        pos += length_size
        if size == 0 or pos + size > len(data):
            return
        yield data[pos : pos + size]
        pos += size


def h264_reference(data: bytes, length_size: int | None) -> bool | None:
    for nal in nal_units(data, length_size):
        if nal and 1 <= nal[0] & 0x1F <= 5:
            return (nal[0] >> 5) & 3 != 0
    return None


def hevc_reference(data: bytes, length_size: int | None) -> bool | None:
    for nal in nal_units(data, length_size):
        if len(nal) >= 2 and (nal_type := (nal[0] >> 1) & 0x3F) <= 31:
            return not (nal_type < 16 and nal_type % 2 == 0)
    return None


def mpeg4_reference(data: bytes) -> bool | None:
    vop = START_CODE + b"\xb6"
    first = data.find(vop)
    if first < 0 or first + 4 >= len(data) or data.find(vop, first + 4) >= 0:
        return None
    return data[first + 4] >> 6 != 2


def mpeg2_reference(data: bytes) -> bool | None:
    picture = data.find(START_CODE + b"\x00")
    if picture < 0 or picture + 5 >= len(data):
        return None
    return (data[picture + 5] >> 3) & 7 != 3


def length_size(codec: str, extradata: bytes | None) -> int | None:
    """The NAL length prefix of an ``avcC`` / ``hvcC`` record, None for Annex B."""
    if not extradata or extradata[0] != 1:
        return None
    if codec == "h264" and len(extradata) > 4:
        return (extradata[4] & 3) + 1
    if codec == "hevc" and len(extradata) > 21:
        return (extradata[21] & 3) + 1
    return None


# FFmpeg's decoder name -> (the NAL length prefix, None for Annex B) -> a packet's reader.
READERS: dict[str, Callable[[int | None], Callable[[bytes], bool | None]]] = {
    "h264": lambda size: functools.partial(h264_reference, length_size=size),
    "hevc": lambda size: functools.partial(hevc_reference, length_size=size),
    "mpeg4": lambda size: mpeg4_reference,
    "mpeg2video": lambda size: mpeg2_reference,
}


def reference_reader(codec: str, extradata: bytes | None) -> Callable[[bytes], bool | None] | None:
    """A packet -> is-its-frame-a-reference reader for ``codec`` (FFmpeg's decoder name and the
    stream's extradata), or None for a codec not in :data:`READERS`."""
    make = READERS.get(codec)
    return None if make is None else make(length_size(codec, extradata))
