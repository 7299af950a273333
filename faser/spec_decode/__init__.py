"""Speculative decoding: a draft proposes, the target verifies, and the output is the target's own.

Each mechanism in one sentence, by the module that owns it:

- `speculator`: one step over the scheduled batch, plan -> propose -> trim -> verify -> observe;
  a step in which nobody drafts runs as policy `off` does, the target writing its features.
- `proposer`: the draft proposes k_i tokens per request over a ragged batch, stopping a greedy
  line once its cumulative confidence falls below a threshold.
- `lookup`: prompt lookup guesses a greedy request's next token from an earlier occurrence of its
  newest tokens, and takes the draft's place where it is likelier to be right.
- `verifier`: the target verifies the drafts in frontiers, and a request with a rejection gets no
  more target compute in the step (early pruning); a request whose rows are not finite ends
  with an error, alone.
- `estimator`: one acceptance estimate per request (its decayed trials with the population's rate
  as prior, blended after drafting with the draft's calibrated confidence).
- `cost_model`: a step's price from the profiled forwards, each phase scaled by what served steps
  measured.
- `planner`: the k vector with the best goodput under the step's limits (token budget, TTFT cap,
  TPOT deadlines), and the frontier size that verifies it most cheaply.
- `slo`: those limits, from each request's TTFT and TPOT targets.
- `policy`: the static baselines (off, fixed, dsd, heuristic) and faser, which plans with the
  planner, trims with the drafts' confidences and takes its mode from the controller.
- `controller`: the mode (`off`, `overlap`, `prune`) read off each plan, and the cap on k while the
  router reports the fleet busy.
- `overlap`: on an engine with two lanes, the draft and the target run at once.
- `request`, `state`: what the layer needs of a request, and what survives across its steps.
- `trace`: one JSON line per step, predicted against realised acceptance and time.
"""
