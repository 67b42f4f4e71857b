"""FusionOptions, the HTTP request's `fusion` object and the wire's fusion dict name the same knobs.

The knobs are declared once, in config's FusionRequestSettings; FusionOptions types them by hand, FusionIn
(api/schemas.py) derives from the settings, and the wire (wire/protocol.py QueryJob.fusion) carries a dict
of them that the worker turns back into FusionOptions. A knob added in one place and not the others fails
here, not in a request.
"""

from __future__ import annotations

import dataclasses
import typing

from kvfuse.config import FusionRequestSettings, Settings
from kvfuse.fusion import FusionOptions
from kvfuse.fusion.types import request_knobs
from kvfuse.service.api.schemas import FusionIn
from kvfuse.service.wire import codec
from kvfuse.service.wire.protocol import ChunkRef, QueryJob

NAMES = [f.name for f in dataclasses.fields(FusionOptions)]


def test_fusion_options_types_and_defaults_are_the_settings_fields() -> None:
    assert NAMES == list(FusionRequestSettings.model_fields)
    hints = typing.get_type_hints(FusionOptions)
    defaults = FusionRequestSettings()
    for name, f in FusionRequestSettings.model_fields.items():
        assert hints[name] == f.annotation, name
        assert getattr(FusionOptions(), name) == getattr(defaults, name) == f.default, name


def test_the_http_fusion_object_carries_the_same_fields() -> None:
    assert list(FusionIn.model_fields) == NAMES
    body = FusionIn.model_validate({"method": "epic", "recompute_ratio": 0.4, "edge_tokens": 3,
                                    "samkv_update": "overwrite", "samkv_cross_cut": False})
    sent = FusionOptions(**(request_knobs(FusionRequestSettings()) | body.model_dump(exclude_none=True)))
    assert (sent.method, sent.recompute_ratio, sent.edge_tokens, sent.samkv_update, sent.samkv_cross_cut) == (
        "epic", 0.4, 3, "overwrite", False)
    assert sent.edge_tokens_end == FusionOptions().edge_tokens_end  # unset: the configured default


def test_the_wire_carries_every_field_and_the_worker_reads_them_back() -> None:
    # What rag/query.py's fusion_options sends: config.fusion's request knobs (its engine knobs left out).
    knobs = request_knobs(Settings().fusion)
    assert list(knobs) == NAMES
    options = FusionOptions(**(knobs | {"method": "a3", "recompute_ratio": 0.25, "check_layer": 2,
                                        "samkv_min_p": 0.1, "link_tokens": 0}))
    job = QueryJob(question="q", system_prompt=None, explicit=False, fusion=dataclasses.asdict(options),
                   generation={}, chunks=[ChunkRef(key="k", token_ids=[1, 2])])
    got = codec.decode(codec.encode(job))  # a fleet's Redis stream; the local pipe pickles the same dict
    assert isinstance(got, QueryJob) and set(got.fusion) == set(NAMES)
    assert FusionOptions(**got.fusion) == options  # as sequences.py builds it in the worker
