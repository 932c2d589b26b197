"""Tasks written the way a user writes them: a flax NNX model, a loss and data, handed to
``trainers.train(cfg, task)`` (or ``spmd-train module:task``) through :class:`trainers.task.Task`.

- :mod:`trainers.examples.digits`: an MLP-Mixer with BatchNorm and dropout on the 8x8 handwritten
  digits (``data/digits.csv.gz``), with eval accuracy.
- :mod:`trainers.examples.decoder`: a decoder LM that is not the built-in GPT (parallel attention
  and MLP blocks, LayerNorm with biases, learned positions, dropout) on the toolkit's byte corpus.
- :mod:`trainers.examples.sft`: supervised fine-tuning of the built-in GPT on a chat dataset in
  Parquet, documents packed with segment ids and the prompt left out of the loss.
"""
