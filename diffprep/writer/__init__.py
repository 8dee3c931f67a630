"""What is written: the plan (the source cut into units), reproducible tar shards and unit manifests, the member
layouts, and the cookers that read them back."""
