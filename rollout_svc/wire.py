"""The wire codec of `rollout_svc.protocol`: msgspec's MessagePack encoder and typed decoders.

Encoding walks a message's fields straight from the model (no `model_dump`); decoding splits the envelope without
touching its body, then either validates the body with the model (pydantic: requests, commands, weight-sync orders,
what arrives from a producer or an operator) or, for what workers answer (trajectories, chunks, error and tokenize
results: the hot path, one per request), checks it with a msgspec Struct generated from the model's fields (types,
literals, tuples; C speed) and builds the model from the checked values without validating it again. vLLM's
engine-core IPC uses msgspec's MessagePack the same way. `Message` is the base of every model the codec carries
(`rollout_svc.protocol`, `rollout_svc.orders`).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict

M = TypeVar("M", bound=BaseModel)


class Envelope(msgspec.Struct):
    """`{"v": schema version, "t": type name, "b": body}`; the body stays undecoded until its type is known."""

    v: Any
    t: Any
    b: msgspec.Raw


ENVELOPE = msgspec.msgpack.Decoder(Envelope)


class Message(BaseModel):
    """A wire message (the base of every model `rollout_svc.protocol` encodes): fields it does not know are ignored
    (a newer peer of the same schema version); frozen."""

    model_config = ConfigDict(extra="ignore", frozen=True)


def _fields_of(model: BaseModel) -> Any:
    """A model's fields for the encoder, extras (a model that allows them) included."""
    extra = model.__pydantic_extra__
    return {**model.__dict__, **extra} if extra else model.__dict__


ENCODER = msgspec.msgpack.Encoder(enc_hook=lambda obj: _fields_of(obj) if isinstance(obj, BaseModel) else obj)


def encode_envelope(version: int, message: BaseModel) -> bytes:
    """MessagePack of the envelope of `message` (nested models encoded as their fields)."""
    return ENCODER.encode({"v": version, "t": type(message).__name__, "b": message})


class WireModel:
    """A model's fast path, for flat models whose fields msgspec can check (no nested models, validators or numeric
    constraints): what workers answer. `decode` checks a body with a msgspec Struct mirroring the model's fields (the
    same names, types and defaults) and builds the model from the checked values without pydantic's validation;
    `build` builds it from values this process computed."""

    def __init__(self, model: type[M]) -> None:
        self.model = model
        required, optional = [], []
        for name, info in model.model_fields.items():
            if info.is_required():
                required.append((name, info.annotation))
            elif info.default_factory is not None:
                factory: Any = info.default_factory  # no factory of these models takes the validated data
                optional.append((name, info.annotation, msgspec.field(default_factory=factory)))
            else:
                optional.append((name, info.annotation, info.default))
        self.struct = msgspec.defstruct(f"{model.__name__}Wire", [*required, *optional])
        self.decoder = msgspec.msgpack.Decoder(self.struct)
        fields = model.model_fields.items()
        self._defaults = {n: i.default for n, i in fields if not i.is_required() and i.default_factory is None}
        self._factories = {n: i.default_factory for n, i in fields if i.default_factory}

    def decode(self, body: bytes | msgspec.Raw) -> Any:
        """The model of `body`. Raises `msgspec.ValidationError` or `msgspec.DecodeError`."""
        return self.make(self.values(body))

    def values(self, body: bytes | msgspec.Raw) -> dict[str, Any]:
        """The checked values of `body` by field name, every field present: what `make` builds the model of. Raises
        `msgspec.ValidationError` or `msgspec.DecodeError`."""
        return msgspec.structs.asdict(self.decoder.decode(body))

    def build(self, **values: Any) -> Any:
        """The model of `values` (every required field given, the rest defaulted), not validated: for what this
        process computed itself (pydantic's `model_construct`, without its per-field walk)."""
        for name, factory in self._factories.items():
            if name not in values:
                values[name] = factory()  # type: ignore[call-arg]
        return self.make({**self._defaults, **values})

    def make(self, values: dict[str, Any]) -> Any:
        """The model of `values` (every field present), not validated; it takes `values` as its own."""
        obj = self.model.__new__(self.model)
        object.__setattr__(obj, "__dict__", values)
        object.__setattr__(obj, "__pydantic_fields_set__", set(values))
        object.__setattr__(obj, "__pydantic_extra__", None)
        object.__setattr__(obj, "__pydantic_private__", None)
        return obj
