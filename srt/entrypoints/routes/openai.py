"""The OpenAI API (/v1/...): the model list here; chat by ``app.state.openai_serving``
(srt/entrypoints/openai_serving.py), completions by openai_completions.py."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.entrypoints.http_common import error_response
from srt.entrypoints.openai_completions import serve_completions
from srt.entrypoints.openai_responses import ModelCard, ModelList


def _card(state) -> ModelCard:
    return ModelCard(id=state.served_model_name, root=state.server_args.model_path,
                     max_model_len=state.tokenizer_manager.context_len)


async def models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[_card(request.app.state)]).model_dump())


async def model(request: Request, model_id: str) -> JSONResponse:
    """OpenAI's model retrieval: the served model's card, a 404 for any other id."""
    card = _card(request.app.state)
    if model_id != card.id:
        return error_response(f"The model {model_id!r} does not exist: this server serves {card.id!r}.",
                              404, param="model")
    return JSONResponse(card.model_dump())


async def chat_completions(request: Request) -> Response:
    return await request.app.state.openai_serving.chat_completions(request)


async def completions(request: Request) -> Response:
    return await serve_completions(request.app.state.openai_serving, request)


def openai_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])  # ids may hold "/"
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", completions, methods=["POST"])
    return router
