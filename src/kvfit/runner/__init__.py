"""The model runner: StepPlan -> tensors -> model -> sampled tokens."""
