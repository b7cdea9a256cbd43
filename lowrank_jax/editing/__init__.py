"""Model editing: counterfactual fact edits with CrispEdit (curvature-projected Adam), plain
fine-tuning or LoRA, and their metrics (the application behind ``lowrank-jax edit``)."""

from lowrank_jax.editing.edit import (
    EditBatch,
    EditConfig,
    EditRequest,
    capability_data,
    capability_metrics,
    edit_model,
    edit_scores,
    evaluate_edits,
    load_edits,
    matching_layers,
    parse_edits,
    text_sequences,
    tokenize_edits,
)

__all__ = [
    "EditBatch", "EditConfig", "EditRequest", "capability_data", "capability_metrics",
    "edit_model", "edit_scores", "evaluate_edits", "load_edits", "matching_layers", "parse_edits",
    "text_sequences", "tokenize_edits",
]
