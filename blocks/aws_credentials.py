"""Saved AWS (or S3-compatible) credentials, the secret parts stored as secrets."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class AwsS3Credentials(Block):
    """Keys for the S3 buckets a run reads from or writes to (AWS, MinIO, Ceph, R2).

    Pass the block's name as ``auth.aws_credentials_block``; tasks load it
    where they run and hand the keys to boto3 and Energon's storage client
    through the process's standard ``AWS_*`` variables, so the keys never travel
    in flow parameters, plan.json, logs or artifacts. Without a block the
    standard AWS chain applies (env, profile, instance role).
    """

    _block_type_name = "diffprep S3 credentials"
    _block_type_slug = "diffprep-s3-credentials"
    _description = "An access key pair (and optional session token) for S3-compatible storage."

    aws_access_key_id: str = Field(description="The access key id, e.g. AKIA...")
    aws_secret_access_key: SecretStr = Field(description="The secret access key.")
    aws_session_token: SecretStr | None = Field(None, description="A session token, for temporary credentials.")
    region_name: str | None = Field(None, description="The region, e.g. us-east-1; unset: the AWS chain's.")

    def environment(self) -> dict[str, str]:
        """The standard variables boto3 and the Multi-Storage Client read."""
        env = {"AWS_ACCESS_KEY_ID": self.aws_access_key_id,
               "AWS_SECRET_ACCESS_KEY": self.aws_secret_access_key.get_secret_value()}
        if self.aws_session_token is not None:
            env["AWS_SESSION_TOKEN"] = self.aws_session_token.get_secret_value()
        if self.region_name:
            env["AWS_DEFAULT_REGION"] = self.region_name
        return env
