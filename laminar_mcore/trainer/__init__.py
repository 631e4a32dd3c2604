"""The trainer role: Megatron-Core model building, packed batches, log-probs, the train step,
checkpoints, the export of a stage as Hugging Face tensors and the publisher; ``loop.run`` is a
trainer rank of a multi-node run.

Trainer code never imports engine code (``laminar_mcore.rollout``); it meets the engines only in
``laminar_mcore.weights`` formats and ``laminar_mcore.data`` types, and the controller only
through ``controller.client.ControllerClient``.
"""
