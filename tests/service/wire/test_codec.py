"""The fleet's wire form of the protocol messages (kvfuse.service.wire.codec): every message type survives a
round trip through stream fields, and nothing but a protocol message is ever read back."""

from __future__ import annotations

import pytest

from kvfuse.service.wire import protocol as P
from kvfuse.service.wire.codec import CodecError, decode, encode

MESSAGES = [
    P.QueryJob("q?", None, False, {"method": "anchor"}, {"max_tokens": 4}, [P.ChunkRef("k1", [1, 2, 3], 0.5)], 7),
    P.PrecomputeJob([[1, 2], [3]], 8), P.PrecomputeJob([[1, 2], [3]], 9, [[7], []]), P.Cancel(3), P.Shutdown(),
    P.Plan(1, [0], [1], 10, 5, 3, step=2), P.Delta(1, "héllo", 3),
    P.Result(1, "text", "stop", {"generated_tokens": 2}, {"decode_s": 0.1}, 1, 4, worker="gpu-1"),
    P.Done(2, ["k"], [100], 1, 5, worker="gpu-2"), P.Error(3, P.ERR_WORKER_LOST, "gone", None, 6),
    P.Step(1, 2, [3], None, 1, 0, 10), P.Ready({"fingerprint": "f"}), P.Fatal("bad"),
    # a conversation's earlier turns, and logprobs asked for
    P.QueryJob("and then?", "sys", False, {"method": "anchor"}, {"max_tokens": 4, "logprobs": 2},
               [P.ChunkRef("k1", [1, 2], 1.0)], 9, history=[["user", "first?"], ["assistant", "yes"]]),
    P.Delta(1, " a", 3, logprobs=[[264, -0.25, [[264, -0.25], [11, -2.5]]]]),
    P.Result(1, " a", "length", {"generated_tokens": 1}, {}, 0, 4, logprobs=[[264, -0.25, [[264, -0.25]]]]),
    P.ShadowResult("anchor", 0.15, 900, True, 0.03, 7, 5, 1200, 9, worker="gpu-1"),
    P.ShadowResult("anchor", 0.15, 900, None, 0.5, 3), P.ShadowDropped("epic", 4, worker="gpu-1"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    fields = encode(msg, uid="abc")
    assert all(isinstance(v, str) for v in fields.values()) and fields["uid"] == "abc"
    assert decode(fields) == msg


def test_only_protocol_messages() -> None:
    with pytest.raises(CodecError):
        encode(object())
    with pytest.raises(CodecError):
        decode({"t": "os.system", "d": "{}"})
    with pytest.raises(CodecError):
        decode({"t": "Delta", "d": '{"job_id": 1}'})
