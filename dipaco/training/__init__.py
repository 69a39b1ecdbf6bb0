"""Training: the in-process and torchrun engine (``--engine local``), and the steps every engine shares.

  ``train.py``         the round loop: H inner steps of every trainee, then the outer sync, validation, checkpoint
  ``trainee.py``       one trainee (path replica, AdamW, data) and its inner step, shared by both engines
  ``sync.py``          the outer sync after each inner step (prepare, perform), Streaming DiLoCo's fragments
  ``outer.py``         the outer step: outer gradients, the per-module average, outer Nesterov SGD
  ``engine_steps.py``  the round steps both engines take the same way (inner record, rescale-and-step, round line)
  ``comm.py``          the workers' communication: the only torch.distributed user
  ``streaming.py``, ``quant.py``, ``devices.py``, ``launch.py``: fragments, quantized transport, devices, torchrun
"""
