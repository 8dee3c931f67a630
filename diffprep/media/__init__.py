"""Media preparation: clips probed and decoded with PyAV (``video``), their audio tracks (``audio``), and
resolution buckets for clips and images (``buckets``). Import the modules themselves: this package imports
nothing, so ``diffprep.media.images`` can use the buckets without loading the video decoder."""
