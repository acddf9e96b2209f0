"""specstream.v1.ConfigService: the model's description, the engine's configuration, and a dry
run of a configuration (ValidateConfig lists every problem at once)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from service import __version__
from service.config import EngineConfig
from service.errors import NotServedError
from service.proto_build import stubs

if TYPE_CHECKING:                # generated on first use (service.proto_build.stubs)
    from service.proto import config_pb2
    from service.server import ServingState


def engine_config_from_proto(msg: config_pb2.EngineConfig, base: EngineConfig) -> EngineConfig:
    """The fields set in msg over base (ValidateConfig's dry run)."""
    return replace(base, **{f.name: getattr(msg, f.name) for f in fields(EngineConfig)
                            if msg.HasField(f.name)})


def engine_config_to_proto(cfg: EngineConfig) -> config_pb2.EngineConfig:
    return stubs().config_pb2.EngineConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})


def model_info_to_proto(info: Any, cfg: EngineConfig) -> config_pb2.ModelInfo:
    msg = stubs().config_pb2.ModelInfo(
        name=info.name, architecture=info.architecture, file_type=str(info.file_type),
        n_params=int(info.n_params), n_ctx_train=int(info.n_ctx_train), n_ctx=int(info.n_ctx),
        vocab_size=int(info.vocab_size), eog_ids=[int(i) for i in info.eog_ids],
        backend=str(info.backend), drafter=cfg.drafter,
        draft_model=str(getattr(info, "draft_model", "")),
        kv_cache_type_k=cfg.kv_cache_type_k, kv_cache_type_v=cfg.kv_cache_type_v,
        server_version=__version__)
    if info.bos_id is not None:
        msg.bos_id = int(info.bos_id)
    if info.eos_id is not None:
        msg.eos_id = int(info.eos_id)
    if info.chat_template:
        msg.chat_template = info.chat_template
    return msg


class ConfigServicer:
    """specstream.v1.ConfigService (registered by build_server)."""

    def __init__(self, state: ServingState) -> None:
        self._state = state

    def _served(self, method: str) -> None:
        if not self._state.server_config.config_rpcs:
            raise NotServedError(f"{method} is turned off on this server (config_rpcs false)")

    def _effective(self) -> EngineConfig:
        engine = self._state.engine
        return engine.config if engine is not None else self._state.engine_config

    async def GetModelInfo(self, request, context) -> config_pb2.ModelInfo:
        engine = self._state.require_engine()
        return model_info_to_proto(engine.info, engine.config)

    async def GetConfig(self, request, context) -> config_pb2.GetConfigResponse:
        self._served("GetConfig")
        return stubs().config_pb2.GetConfigResponse(
            config=engine_config_to_proto(self._effective()))

    async def ValidateConfig(self, request: config_pb2.ValidateConfigRequest,
                             context) -> config_pb2.ValidateConfigResponse:
        self._served("ValidateConfig")
        pb = stubs().config_pb2
        candidate = engine_config_from_proto(request.config, self._effective())
        problems = candidate.problems()
        return pb.ValidateConfigResponse(
            valid=not problems, config=engine_config_to_proto(candidate),
            problems=[pb.ConfigProblem(field=f, message=m) for f, m in problems])
