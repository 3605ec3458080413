"""Output processing: a step's output is a snapshot, whatever the engine thread does next."""

from __future__ import annotations

from common.engine.output import OutputProcessor
from common.engine.request import Request
from common.engine.sampler import SampledToken
from common.engine.sampling_params import SamplingParams


def test_a_step_output_keeps_its_own_tokens_and_logprobs(tokenizer):
    # the engine thread makes a step's output, the event loop formats it later; by then the
    # engine may have appended the next tokens to the request (a stream named their strings)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=8, logprobs=1))
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(req)
    req.append_token(SampledToken(40, -1.0, [(40, -1.0)]))
    first, _ = outputs.process(req)
    req.append_token(SampledToken(41, -2.0, [(41, -2.0)]))
    second, _ = outputs.process(req)
    req.append_token(SampledToken(42, -3.0, [(42, -3.0)]))  # not processed yet
    assert first.delta_token_ids == [40] and [t.token_id for t in first.delta_logprobs] == [40]
    assert [t.token_id for t in first.logprobs] == [40]
    assert second.delta_token_ids == [41] and [t.logprob for t in second.delta_logprobs] == [-2.0]
    assert [t.token_id for t in second.logprobs] == [40, 41]


def test_no_logprobs_requested_means_none(tokenizer):
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=8))
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(req)
    req.append_token(SampledToken(40))
    out, _ = outputs.process(req)
    assert out.delta_token_ids == [40] and out.logprobs is None and out.delta_logprobs == []
