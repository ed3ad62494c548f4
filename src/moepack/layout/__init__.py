"""Expert layout: plans (new slot -> old expert per MoE block), cost model, ordering."""
