"""What a run shows: findings, pictures and contact sheets, latent statistics, the validation report."""
