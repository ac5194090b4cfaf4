"""How responses are produced: generation (the decoding mode and loop, sampling) and, for
multi-turn rollouts, the environment."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ppo.config.section_base import Section


# ------------------------------------------------------------------------- generation
class GenerationConfig(Section):
    mode: Literal["auto", "gathered", "tensor_parallel", "zero3"] = Field(
        "auto",
        description="gathered: copy the policy's 16-bit weights once per rollout into a hook-free "
        "replica on each rank (fast); tensor_parallel: generation.tp_size ranks hold one replica "
        "between them (attention heads and MLP columns split, a mixture-of-experts layer's "
        "experts split by expert; for policies whose 16-bit copy does not fit one device); "
        "zero3: generate through the ZeRO-3 hooks, gathering layer by layer for every token "
        "(slow; the last resort); auto: gathered when the replica fits in "
        "generation.replica_memory_fraction of free device memory, else tensor_parallel when a "
        "1/tp_size shard does, else zero3.")
    replica_memory_fraction: float = Field(
        0.5, gt=0, le=1, description="auto mode: share of free device memory the replica (or "
        "its tensor-parallel shard) may use.")
    tp_size: int | None = Field(
        None, gt=0, description="tensor_parallel mode: consecutive ranks sharing one replica; "
        "default: the ranks of one node. Must divide the world size and the policy's attention "
        "heads, MLP width and experts per layer, and divide its KV heads or be a multiple of "
        "them (then each rank holds one KV head).")
    max_new_tokens: int = Field(128, gt=0, description="Longest response in tokens.")
    min_new_tokens: int = Field(0, ge=0, description="EOS (and every stop token) is "
                                "suppressed before this many tokens of a turn; the trainer's "
                                "log-probs suppress it alike.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 = greedy. Scoring "
                               "and the update divide the logits by it too.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass. The policy's "
                         "log-probs, entropy and ratio are of the same truncated, renormalised "
                         "distribution (exact on-policy PPO); the reference's log-probs use its "
                         "full softmax (docs/SAMPLING.md).")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off. In the log-probs as "
                       "top_p is.")
    stop_tokens: list[str] = Field(
        default_factory=list,
        description="Extra tokens (each one vocabulary entry) that end a response like EOS.")
    batch_size: int | None = Field(
        None, gt=0, description="Rows decoded at once on each rank (a prompt counts "
        "ppo.samples_per_prompt times: one row per response); default: the rank's whole share "
        "of the rollout batch. With continuous batching these are slots that take the next "
        "prompt when their response ends; otherwise each generate call takes this many.")
    continuous: Literal["auto"] | bool = Field(
        "auto", description="Continuous batching in our decoding loop (loop=own): the "
        "generation.batch_size rows decoding at once are slots; every stop_check_every steps "
        "the slots whose responses ended take the next prompts (prefilled into the slot), so "
        "short responses do not wait for the longest one of their call. Rows come back in "
        "prompt order; greedy outputs equal HF generate's. auto: on when the rank has more "
        "rows than batch_size and the loop is own; false: one generate call per batch_size "
        "rows, each until its longest response ends; true: as auto, and an error when the "
        "loop is hf.")
    loop: Literal["auto", "own", "hf"] = Field(
        "auto", description="Decoding loop on the gathered replica. own: ds_ppo's loop (static "
        "KV cache, sampling on the device, one CUDA graph per token on CUDA, no per-token host "
        "sync); hf: HF generate (cache_implementation and compile apply to it only); auto: own "
        "unless the model is not supported by it (an attention kernel other than sdpa/eager, "
        "sliding-window layers) or cache_implementation/compile ask for HF generate. zero3 mode "
        "always uses HF generate.")
    cuda_graph: bool = Field(
        True, description="loop=own on CUDA: capture the decoding step once per generate call "
        "as a CUDA graph and replay it for every token. In tensor_parallel mode the graph "
        "holds the step's all-reduces and the group's ranks capture together; if capture "
        "fails on any of them, all decode eagerly (the reason is logged once).")
    stop_check_every: int = Field(
        8, gt=0, description="loop=own: decoding steps between checks whether every response "
        "has ended, and with continuous batching between refills of the ended rows' slots "
        "(each check waits for the device; a slot idles up to this many steps minus one: "
        "8 keeps >= 88% of continuous batching's slot-steps busy, 16 79-84%, "
        "docs/PERFORMANCE.md).")
    cache_implementation: Literal["dynamic", "static"] = Field(
        "dynamic", description="loop=hf: KV cache of the gathered replica; static enables "
        "transformers' compiled decoding.")
    compile: bool = Field(False, description="loop=hf: torch.compile the replica's decoding step.")
    batch_invariant: bool = Field(
        False, description="Every forward of the iteration (the decoding steps, scoring, the "
        "update) runs batch-invariant kernels (ds_ppo/engine/batch_invariant.py: linear layers "
        "and attention reduce in an order that depends on neither the batch nor the sequence "
        "layout), so the sampler's log-probs equal the trainer's to the last bit: "
        "rollout/logprob_abs_diff_max is 0 (whole replicas: mode gathered, sdpa or eager "
        "attention; not with loop=hf, which keeps no sampler log-probs). Pure torch: slower, most "
        "of all on a GPU (docs/SAMPLING.md).")
    require_exact: bool = Field(
        False, description="Stop the run (one line, exit code 2, before the iteration's update) "
        "when the sampler's log-probs differ from the trainer's by anything: the iteration's "
        "rollout/logprob_abs_diff_max over all ranks must be 0. The proof in the run that PPO "
        "trains the distribution it sampled (docs/SAMPLING.md); needs the comparison: "
        "generation.loop=own and ppo.old_logprobs=training.")
    keep_replica: bool = Field(
        False, description="Keep the gathered replica between rollouts and refresh its weights "
        "in place: no re-allocation and no recompilation, at the cost of its 16-bit weights "
        "staying in device memory during training.")
    compile_step: bool = Field(
        False, description="loop=own: run the decoding step's forward compiled by torch.compile "
        "(inductor, static shapes), inside the CUDA graph on CUDA: fused elementwise kernels "
        "instead of eager's many small ones (docs/PERFORMANCE.md, the decode step). The first "
        "generate call compiles it (tens of seconds for a 1B model); needs keep_replica=true, "
        "so the compiled step lives as long as the replica. Greedy outputs equal the eager "
        "step's in fp32.")


# ------------------------------------------------------------------------ environment

    @property
    def hf_generate(self) -> bool:
        """True when responses come from HF generate (loop hf, or mode zero3 through the hooks),
        which keeps no sampler log-probs; else from our decoding loop."""
        return self.loop == "hf" or self.mode == "zero3"

    def problems(self) -> list[str]:
        g, out = self, []
        if g.min_new_tokens > g.max_new_tokens:
            out.append(f"generation.min_new_tokens = {g.min_new_tokens} must be <= "
                       f"generation.max_new_tokens = {g.max_new_tokens}")
        if g.loop == "own" and g.mode == "zero3":
            out.append("generation.loop = 'own' runs on the gathered replica, but "
                       "generation.mode = 'zero3' generates through the ZeRO-3 hooks: set "
                       "generation.loop=auto (or hf), or generation.mode=gathered")
        if g.loop == "own" and (g.cache_implementation != "dynamic" or g.compile):
            out.append("generation.cache_implementation / generation.compile are options of "
                       "HF generate (generation.loop=hf); generation.loop = 'own' always uses "
                       "a static cache and CUDA graphs (generation.cuda_graph): drop them or "
                       "set generation.loop=hf")
        if g.compile_step and g.hf_generate:
            out.append("generation.compile_step compiles our decoding loop's step, but "
                       f"generation.loop = {g.loop!r} / generation.mode = {g.mode!r} use HF "
                       "generate: drop it, or set generation.loop=own (mode gathered or "
                       "tensor_parallel)")
        elif g.compile_step and not g.keep_replica:
            out.append("generation.compile_step needs generation.keep_replica=true (a new "
                       "replica per rollout would compile its step again every time): set "
                       "generation.keep_replica=true, or drop generation.compile_step")
        if g.hf_generate and g.continuous is True:
            out.append("generation.continuous = true needs our decoding loop, but "
                       f"generation.loop = {g.loop!r} / generation.mode = {g.mode!r} use HF "
                       "generate: set generation.continuous=auto, or generation.loop=own")
        return out


class EnvConfig(Section):
    """Multi-turn rollouts: each response is an episode of model turns and environment
    observations (docs/GUIDE.md "Environments and tools", docs/ENVIRONMENTS.md). Unset (no
    function, no url): one prompt -> one response."""

    function: str | None = Field(
        None, description="module:Name of a Python environment, importable like "
        "reward.function: a class (one instance per episode: reset(prompt, **keys), then "
        "step(action) -> Step per model turn) or a stateless step function "
        "f(prompt, actions, **keys) -> Step (actions: the model's turns so far). keys: the "
        "row's data.reward_keys columns.")
    url: str | None = Field(
        None, description="An environment served over HTTP (the stateless step contract of "
        "docs/ENVIRONMENTS.md), with reward.url's conventions: env.batch_size episodes per "
        "request, env.concurrency in flight, env.retries, user:password@ sent as basic auth and "
        "never shown.")
    max_turns: int = Field(4, gt=0, description="Model turns per episode at most; an episode "
                           "still going after them ends (metric env/out_of_turns_frac).")
    max_total_tokens: int = Field(
        512, gt=0, description="Response tokens per episode (model turns and observations "
        "together) at most; a turn or observation that would pass it ends the episode there "
        "(metric env/truncated_frac). generation.max_new_tokens limits each turn.")
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a model turn (e.g. </call>): the "
        "turn is cut after the token that completes the first of them. One that begins or ends "
        "with a letter, digit or _ matches there only as a whole word (\"look\" ends a turn at "
        "\"look at\" or \"look=\", not inside \"looks\" or \"outlook\"). Single tokens can also "
        "go in generation.stop_tokens, which stop the decoding itself.")
    observation_role: str = Field(
        "tool", description="Chat prompts: the role of an observation given as text (a Step "
        "may give a whole message instead).")
    timeout_s: float | None = Field(
        60.0, gt=0, description="Limit of one environment call (a reset or step of one episode; "
        "env.url: one request, then retried). A call that raises or hangs stops the run with "
        "its name after a checkpoint of the last completed iteration; null: no limit.")
    concurrency: int = Field(16, gt=0, description="Environment calls in flight at once on "
                             "each rank (Python: worker threads; env.url: requests).")
    batch_size: int = Field(64, gt=0, description="env.url: episodes per request.")
    retries: int = Field(3, ge=0, le=1000, description="env.url: retries of a request after a "
                         "connection error, a timeout or a 5xx answer (back-off 1, 2, 4... s).")

    @property
    def enabled(self) -> bool:
        return self.function is not None or self.url is not None

    def problems(self) -> list[str]:
        from ds_ppo.redaction import redact_url  # stdlib only: no heavy import

        out = []
        if self.function is not None and self.url is not None:
            out.append(f"env: set one of env.function ({self.function!r}) and env.url "
                       f"({redact_url(self.url)!r}), not both")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            out.append(f"env.url = {redact_url(self.url)!r} must start with http:// or https://")
        if self.function is not None and ":" not in self.function:
            out.append(f"env.function = {self.function!r} must look like module:Name")
        if self.enabled and any(not s for s in self.stop):
            out.append(f"env.stop = {self.stop}: an empty string would end every turn at once")
        return out
