"""Output processing: what one sampled token means for its sequence.

After the engine appends a sampled token, ``token_event`` decides whether the sequence is
done (EOS or a stop token, a stop string, the grammar finished, ``max_tokens``, the context
length) and which text is releasable now: the detokenizer holds back incomplete
characters, the stop matcher holds back text that may still become a stop string, and at
the end both are flushed (a stop string itself is never sent). ``final_event`` fills in
the totals a request's last event carries, however it ended (also cancel and error).

Pure with respect to the engine: it touches only the sequence's own detokenizer, stop
matcher and grammar state, on the engine thread.
"""

from __future__ import annotations

from kvcellar.engine.detokenizer import REPLACEMENT
from kvcellar.engine.sampling import SampleResult
from kvcellar.engine.sequence import Sequence, TokenEvent


def token_event(seq: Sequence, res: SampleResult, max_model_len: int) -> TokenEvent:
    """The event for ``res.token_id``, just appended to ``seq``; ``finish_reason`` set if it
    ends the sequence."""
    tok = res.token_id
    params = seq.params
    n_out = seq.num_tokens - seq.num_prompt_tokens
    finish = None
    error = None
    is_eos = tok in seq.eos_token_ids or tok in params.stop_token_ids
    grammar_done = False
    if seq.constraint is not None:
        if not seq.constraint.accept(tok):  # masked sampling makes this a bug, never a user error
            finish, error = "error", f"constrained decoding failed: {seq.constraint.error}"
        grammar_done = seq.constraint.finished
    if finish is not None:
        text = ""
    elif is_eos:
        finish = "stop"
        text = _flush_text(seq)
    else:
        text, stopped = seq.stop_matcher.feed(seq.detokenizer.push(tok))
        if stopped:
            finish = "stop"
        elif grammar_done or n_out >= params.max_tokens or seq.num_tokens >= max_model_len:
            finish = "stop" if grammar_done else "length"
            tail, stopped = seq.stop_matcher.feed(seq.detokenizer.flush().rstrip(REPLACEMENT))
            text += tail
            if stopped:
                finish = "stop"
            else:
                text += seq.stop_matcher.flush()
    return TokenEvent(
        seq_id=seq.seq_id,
        token_id=tok,
        text=text,
        logprob=res.logprob,
        top_logprobs=res.top_logprobs,
        finish_reason=finish,
        is_eos=is_eos,
        error=error,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens or 0,
        num_output_tokens=n_out,
    )


def _flush_text(seq: Sequence) -> str:
    text, stopped = seq.stop_matcher.feed(seq.detokenizer.flush().rstrip(REPLACEMENT))
    return text if stopped else text + seq.stop_matcher.flush()


def final_event(seq: Sequence, event: TokenEvent) -> TokenEvent:
    """``event`` (with ``finish_reason`` set) completed with the request's totals."""
    event.num_prompt_tokens = seq.num_prompt_tokens
    event.num_cached_tokens = seq.num_cached_tokens or 0
    event.cached_tokens_by_tier = dict(seq.cached_tokens_by_tier)
    event.num_output_tokens = seq.num_tokens - seq.num_prompt_tokens
    event.stop_string = seq.stop_matcher.matched
    return event
