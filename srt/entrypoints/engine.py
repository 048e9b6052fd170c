"""Offline API: ``Engine(...).generate(...)`` runs the same scheduler processes as the server,
with the frontend's TokenizerManager living in the caller's process."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Optional, Union

from srt.entrypoints.launcher import launch_schedulers, new_port_args, prepare_server_args
from srt.frontend.tokenizer_manager import GenerateReqInput, TokenizerManager
from srt.server_args import ServerArgs
from srt.tokenizer_utils import get_tokenizer

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


class Engine:
    """``Engine(model_path=None, **server_args)``; use as a context manager or call shutdown()."""

    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        fields = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"Unknown Engine argument(s): {', '.join(unknown)}")
        self.server_args = prepare_server_args(ServerArgs(model_path=model_path, **kwargs))
        if self.server_args.nnodes > 1:
            raise ValueError("Engine runs on one node; use launch.py for --nnodes > 1")
        self.port_args = new_port_args(self.server_args, None)
        try:
            self._handles = launch_schedulers(self.server_args, self.port_args)
        except BaseException:
            self.port_args.remove_local_dir()
            raise
        self.tokenizer = get_tokenizer(
            self.server_args.tokenizer_path or self.server_args.model_path,
            self.server_args.chat_template)
        self.tokenizer_manager = TokenizerManager(
            self.server_args, self.port_args, self._handles.info, self.tokenizer,
            self._handles.input_addrs)
        self._loop = asyncio.new_event_loop()

    @property
    def scheduler_info(self):
        return self._handles.info

    def generate(self, prompt: Union[Prompt, list[Prompt]],
                 sampling_params: Union[dict, list[dict], None] = None,
                 **logprob_args: Any) -> Union[dict, list[dict]]:
        """Generate for one prompt (text or token ids) or a list; returns dict(s) with
        ``text``, ``output_ids`` and ``meta_info`` (token counts, finish_reason); a
        prompt with ``n`` > 1 gives a list of n such dicts. ``logprob_args``: the native
        API's return_logprob, top_logprobs_num, logprob_start_len, return_text_in_logprobs.
        Invalid input raises ValueError with the same message the HTTP server returns."""
        allowed = {"return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs"}
        if set(logprob_args) - allowed:
            raise TypeError(f"Unknown generate argument(s): {', '.join(sorted(set(logprob_args) - allowed))}")
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], int))
        prompts = [prompt] if single else list(prompt)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError("sampling_params list must match the number of prompts")
            params = sampling_params
        else:
            params = [sampling_params or {}] * len(prompts)
        outs = self._loop.run_until_complete(self._generate_all(prompts, params, logprob_args))
        return outs[0] if single else outs

    async def _generate_all(self, prompts: list[Prompt], params: list[dict], extra: dict) -> list[dict]:
        self.tokenizer_manager.start_handle_loop()
        task = asyncio.gather(*(self._one(p, sp, extra) for p, sp in zip(prompts, params)))
        while True:  # never wait forever on a scheduler that died
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return list(task.result())
            if not self._handles.alive():
                task.cancel()
                raise RuntimeError("a scheduler process exited; see its log above")

    async def _one(self, prompt: Prompt, sampling_params: dict, extra: dict) -> dict:
        if isinstance(prompt, str):
            obj = GenerateReqInput(text=prompt, sampling_params=sampling_params, **extra)
        else:
            obj = GenerateReqInput(input_ids=list(prompt), sampling_params=sampling_params, **extra)
        last = None
        async for out in self.tokenizer_manager.generate_request(obj):
            last = out
        if last is None:
            raise RuntimeError("the scheduler returned no output")
        return last

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        task = self.tokenizer_manager.handle_task
        self.tokenizer_manager.close()
        if task is not None:  # let the cancelled receive loop finish inside its own loop
            self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        self._handles.shutdown()
        self.port_args.remove_local_dir()
        self._loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
