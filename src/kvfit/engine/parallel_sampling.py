"""n samples of one prompt (vLLM v1's parallel sampling): the engine fans a request out into n child
requests that share the prompt (so prefix caching shares its blocks) and folds their outputs back into
one RequestOutput, samples ordered by index.

Child i is request f"{i}_{parent_id}" with params.for_sample(i): n=1 and, for a seeded request, seed + i
(vLLM's rule), so seeded samples differ from each other and repeat from run to run. Prompt logprobs
are asked of child 0 only (every child's would be the same).
"""

from __future__ import annotations

from kvfit.engine.output import CompletionOutput, RequestOutput


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


class ParentRequest:
    """The n samples of one request, gathered as the children produce them."""

    def __init__(self, request_id: str, n: int, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.child_ids = [child_request_id(request_id, i) for i in range(n)]
        self.samples: list[CompletionOutput] = [CompletionOutput(index=i) for i in range(n)]
        self.finished = [False] * n
        self.prompt_logprobs = None
        self.num_cached_tokens = 0

    def update(self, child: RequestOutput, index: int) -> None:
        """A child's latest output (its one sample is sample `index`)."""
        self.samples[index] = child.outputs[0]
        self.finished[index] = child.finished
        if index == 0:
            self.prompt_logprobs, self.num_cached_tokens = child.prompt_logprobs, child.num_cached_tokens

    @property
    def done(self) -> bool:
        return all(self.finished)

    def output(self) -> RequestOutput:
        """Every sample so far (finished when all are), ordered by index."""
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs, outputs=list(self.samples), finished=self.done,
                             num_cached_tokens=self.num_cached_tokens)
