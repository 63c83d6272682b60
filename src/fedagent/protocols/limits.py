"""What a receiver is willing to decode (:class:`Limits`), shared by the envelope
(:mod:`fedagent.protocols.codec`) and the tensors (:mod:`fedagent.protocols.tensors`),
and the bounded quotation of a peer's value in an error message (:func:`short`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

# msgpack's packer refuses nesting deeper than 511 and its C unpacker's stack holds
# 1024 levels; no configuration may ask for more than this, so encoding a valid
# envelope can never hit either.
MAX_DEPTH_CAP = 256


@dataclass(frozen=True, slots=True)
class Limits:
    """What a receiver is willing to decode. Every limit is checked before allocation."""

    max_message_bytes: int = 64 * 2**20  # one MQTT payload (a chunk or a small message)
    max_str_len: int = 1 * 2**20
    max_bin_len: int = 64 * 2**20
    max_array_len: int = 100_000
    max_map_len: int = 100_000
    max_tensor_bytes: int = 2**31  # one decoded tensor
    max_tensor_dims: int = 8
    max_depth: int = 32  # nesting of maps/arrays in a body; the body map is depth 1
    # Every msgpack object (map keys included) in one message. Per-container limits
    # alone do not bound memory: 64 MiB of nested empty arrays would become ~3.5 GiB
    # of Python lists, and short strings cost ~17x their wire size.
    max_objects: int = 1_000_000

    def __post_init__(self) -> None:
        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, not {value!r}")
        if self.max_depth > MAX_DEPTH_CAP:
            raise ValueError(f"Limits.max_depth must be at most {MAX_DEPTH_CAP}")


DEFAULT_LIMITS = Limits()


def short(value: object, limit: int = 40) -> str:
    """A bounded repr: peer-controlled values go into error messages and logs."""
    if isinstance(value, dict | list | tuple):  # never repr a structure: it may be deep
        return f"<{type(value).__name__} of {len(value)}>"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<int of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
