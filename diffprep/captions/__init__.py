"""Captions for uncaptioned media: the captioning models (``models``: a transformers vision-language model or an
OpenAI-compatible server, ``server``), their inputs (``frames``: an image or a clip's frames sampled at a rate) and
the tiny random-weight Qwen2.5-VL of the tests (``tiny``). Import the modules themselves: this package imports
nothing, so reading caption settings does not load torch."""
