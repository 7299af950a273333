"""Distillation of the project's own draft model from a target: prompts, the target's answers,
knowledge distillation of a small draft, and its export in the engine's draft format."""
