"""The transport's copy-saving replacements for paho internals give paho's results."""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt import _packet
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fedagent.node.transport import patches

V5 = mqtt.MQTTProtocolVersion.MQTTv5
V311 = mqtt.MQTTProtocolVersion.MQTTv311


def publish_body(topic: bytes, payload: bytes, *, mid: int | None, props: Properties | None) -> bytes:
    """A PUBLISH packet after its fixed header (what decode_publish is given)."""
    out = len(topic).to_bytes(2, "big") + topic
    if mid is not None:
        out += mid.to_bytes(2, "big")
    if props is not None:
        out += props.pack()
    return out + payload


def user_props() -> Properties:
    p = Properties(PacketTypes.PUBLISH)
    p.UserProperty = ("k", "v")
    p.MessageExpiryInterval = 30
    return p


CASES = [
    (
        0x32,
        publish_body(b"fedagent/v1/f/node/a/to/b/update", b"x" * 200_000, mid=7, props=Properties(PacketTypes.PUBLISH)),
        V5,
    ),
    (0x33, publish_body(b"t", b"", mid=65535, props=user_props()), V5),
    (0x30, publish_body(b"t/u", b"payload", mid=None, props=Properties(PacketTypes.PUBLISH)), V5),
    (0x3B, publish_body(b"a", b"\x00\x01", mid=1, props=None), V311),
]


@pytest.mark.parametrize("header, body, protocol", CASES)
def test_decode_publish_gives_pahos_fields(header, body, protocol):
    assert _packet.decode_publish is patches._decode_publish  # installed
    packet = bytearray(body)
    ours = patches._decode_publish(header, packet, protocol)
    theirs = patches._paho_decode_publish(header, bytearray(body), protocol)
    for field in ("dup", "qos", "retain", "topic", "mid", "payload"):
        assert getattr(ours, field) == getattr(theirs, field), field
    if len(theirs.payload) >= patches.STEAL_PAYLOAD:
        assert ours.payload is packet  # not copied: the packet's buffer, its header cut off
    else:
        assert type(ours.payload) is bytes
    assert (ours.properties is None) == (theirs.properties is None)
    if ours.properties is not None:
        assert ours.properties.json() == theirs.properties.json()


@pytest.mark.parametrize(
    "header, body, protocol",
    [
        (0x32, b"\x00", V5),  # no room for the topic length
        (0x32, b"\x00\x09abc", V5),  # topic longer than the packet
        (0x32, b"\x00\x01a\x00", V5),  # no room for the packet id
        (0x30, b"\x00\x01a\x05\x01", V5),  # properties longer than the packet
        (0x30, b"\x00\x01a\xff\xff\xff\xff\x01", V5),  # a 5-byte property length
        (0x30, b"\x00\x00xyz", V311),  # empty topic in MQTT 3.1.1
    ],
)
def test_decode_publish_refuses_what_paho_refuses(header, body, protocol):
    with pytest.raises(MalformedPacket):
        patches._paho_decode_publish(header, bytearray(body), protocol)
    with pytest.raises(MalformedPacket):
        patches._decode_publish(header, bytearray(body), protocol)


def test_large_queued_packets_are_views_small_ones_untouched():
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=V5)
    seen = []
    client._packet_queue = lambda command, packet, mid, qos, info=None: seen.append(packet)
    patches._view_writes(client)
    big, small = bytearray(patches.READ_SIZE + 1), bytearray(10)
    client._packet_queue(0x30, big, 1, 1)
    client._packet_queue(0x30, small, 2, 1)
    assert isinstance(seen[0], memoryview) and seen[0].obj is big
    assert seen[1] is small
