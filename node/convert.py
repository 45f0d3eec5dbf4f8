"""Between the node service's messages (protos/node.proto) and the engine's and the KV
transfer service's own types. Every value a caller sent is checked by the type it
becomes (SamplingParams, KVLayout), so a bad one is a ValueError naming it."""

from __future__ import annotations

from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.messages import target_from_pb, target_to_pb
from tandem.protos import node_pb2 as pb

# Optional scalar fields: unset means the engine's default.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens",
             "logprobs", "skip_special_tokens")


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    kwargs: dict = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    return SamplingParams(ignore_eos=msg.ignore_eos,
                          include_stop_str_in_output=msg.include_stop_str_in_output, **kwargs)


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(ignore_eos=params.ignore_eos,
                            include_stop_str_in_output=params.include_stop_str_in_output,
                            stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**layout.to_dict())


def layout_from_pb(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.model_id, msg.dtype, msg.num_layers, msg.num_kv_heads, msg.head_dim,
                    msg.block_size)


def sink_to_pb(sink: SinkInfo, first_block: int, connector: str) -> pb.Sink:
    return pb.Sink(
        request_id=sink.request_id, address=sink.address, block_ids=list(sink.block_ids),
        first_block=first_block, layout=layout_to_pb(KVLayout.from_dict(sink.layout)),
        expires_at=sink.expires_at, connector=connector,
        target=target_to_pb(sink.target) if sink.target is not None else None,
    )


def sink_from_pb(msg: pb.Sink) -> tuple[SinkInfo, int]:
    """The sink and the first prompt block it receives."""
    if not msg.block_ids:
        raise ValueError("the sink has no blocks")
    try:
        target = target_from_pb(msg.target) if msg.HasField("target") else None
    except TransferError as exc:
        raise ValueError(f"bad sink target: {exc}") from exc
    sink = SinkInfo(msg.request_id, msg.address, tuple(msg.block_ids),
                    layout_from_pb(msg.layout).to_dict(), msg.expires_at, target)
    return sink, msg.first_block
