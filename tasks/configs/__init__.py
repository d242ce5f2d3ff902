"""Flow configs: one pydantic model per flow (one module each), the Prefect parameter form, the
CLI's options and the MLflow params; the sections they share in `sections`.

Every field is typed, bounded and described; unknown fields are rejected. Field groups are
shared by mixing sections into a flow's config. A `profile` (smoke, quick, full) fills the
fields that are not given explicitly; the class defaults are the `quick` profile.
"""
