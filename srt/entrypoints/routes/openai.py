"""The OpenAI API (/v1/...): the model list here; chat by ``app.state.openai_serving``
(srt/entrypoints/openai_serving.py), completions by openai_completions.py."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.entrypoints.openai_completions import serve_completions
from srt.entrypoints.openai_responses import ModelCard, ModelList


async def models(request: Request) -> JSONResponse:
    state = request.app.state
    card = ModelCard(id=state.served_model_name, root=state.server_args.model_path,
                     max_model_len=state.tokenizer_manager.context_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


async def chat_completions(request: Request) -> Response:
    return await request.app.state.openai_serving.chat_completions(request)


async def completions(request: Request) -> Response:
    return await serve_completions(request.app.state.openai_serving, request)


def openai_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", completions, methods=["POST"])
    return router
