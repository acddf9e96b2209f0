"""Which field of an unparsable request holds invalid UTF-8, read from the wire format.

protobuf refuses a message whose string field is not UTF-8 and says only that the message did
not parse. The interceptor then asks `invalid_utf8_field(descriptor, data)`, which walks the
bytes as the wire format lays them out (tag, then a varint, fixed 64/32 bits or a length and
that many bytes) and names the first string field that does not decode, the way the request
errors name fields: oneof members under their oneof (`input.text`), repeated fields with
their index (`stopping.stop_sequences[1]`), nested messages with dots
(`input.chat.messages[0].content`). Anything else that breaks the walk answers None.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_MAX_DEPTH = 32                  # nesting deeper than any of our messages


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _name(field: FieldDescriptor) -> str:
    oneof = field.containing_oneof
    synthetic = oneof is not None and len(oneof.fields) == 1 and oneof.name == "_" + field.name
    return f"{oneof.name}.{field.name}" if oneof is not None and not synthetic else field.name


def _repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)          # newer protobuf; `label` before
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def invalid_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "",
                       depth: int = 0) -> str | None:
    """The path of the first string field of `data` (a `descriptor` message) that is not
    UTF-8, or None."""
    if depth > _MAX_DEPTH:
        return None
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            tag, pos = _varint(data, pos)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                _, pos = _varint(data, pos)
                continue
            if wire in (1, 5):
                pos += 8 if wire == 1 else 4
                continue
            if wire != 2:
                return None                  # groups: none in our protocol
            size, pos = _varint(data, pos)
            payload, pos = data[pos:pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = counts.get(number, 0)
            counts[number] = index + 1
            path = prefix + _name(field)
            if _repeated(field):
                path += f"[{index}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = invalid_utf8_field(field.message_type, payload, path + ".", depth + 1)
                if found:
                    return found
    except (ValueError, IndexError):
        return None
    return None
