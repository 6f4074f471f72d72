"""GET /v1/models and /v1/models/{id}: the loaded model in OpenAI's list shape.

OpenAI clients (and tools that list models before calling /v1/audio/speech) read `data[].id`; `family`
tells which model family the server runs (cosyvoice2, cosyvoice3).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, Field

from cosystream.server.errors import ApiError
from cosystream.server.protocol import ErrorResponse
from cosystream.server.state import ServerState, get_state

router = APIRouter(tags=["OpenAI-compatible"])

DEFAULT_FAMILY = "cosyvoice2"
OWNER = "cosystream"
MAX_MODEL_ID_CHARS = 256
MODEL_ID_PATH = Path(..., min_length=1, max_length=MAX_MODEL_ID_CHARS, description="a model id, or its family")


class ModelCard(BaseModel):
    id: str = Field(description="the model's name: its hub id, or its directory's name")
    object: Literal["model"] = "model"
    created: int = Field(description="when this server loaded it, Unix seconds")
    owned_by: str = OWNER
    family: str = Field(description="model family: cosyvoice2 or cosyvoice3")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _files(engine: Any) -> Any:
    return getattr(getattr(engine, "checkpoint", None), "files", None)


def model_family(engine: Any) -> str:
    """The family from the checkpoint's yaml name (cosyvoice2.yaml, cosyvoice3.yaml)."""
    yaml = getattr(_files(engine), "yaml", None)
    return yaml.stem if yaml is not None else DEFAULT_FAMILY


def model_card(state: ServerState) -> ModelCard:
    root = getattr(_files(state.engine), "root", None)
    model_id = state.settings.model_id or (root.name if root is not None else model_family(state.engine))
    return ModelCard(id=model_id, created=int(state.started_at), family=model_family(state.engine))


@router.get("/v1/models", response_model=ModelList, summary="The model this server runs (OpenAI models.list)")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[model_card(get_state(request))])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard,
            responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
            summary="One model by id (OpenAI models.retrieve)")
async def get_model(request: Request, model_id: str = MODEL_ID_PATH) -> ModelCard:
    card = model_card(get_state(request))
    if model_id not in (card.id, card.family):
        raise ApiError(404, "not_found", f"model: no model {model_id!r} here; GET /v1/models lists it",
                       field="model")
    return card
