"""One redaction rule everywhere (issue 83): which setting names hold secrets, which parts of a value are credentials,
and Spark masking the same in its UI and event logs. The tables hold real configuration names and values, both ways."""

from __future__ import annotations

import pytest

from sparklm.infra import redact
from sparklm.spark.session import redaction_conf

# -- names ----------------------------------------------------------------------------------------------

SECRET_NAMES = [
    # Hadoop connectors (ABFS, S3A, GCS) and what Spark's own default regex misses
    "fs.azure.account.key.acct.dfs.core.windows.net", "spark.hadoop.fs.azure.sas.container.acct.blob.core.windows.net",
    "fs.azure.account.oauth2.client.secret", "fs.s3a.secret.key", "fs.s3a.session.token", "fs.s3a.encryption.key",
    "fs.s3a.access.key",  # the key's id: half a credential
    "fs.gs.auth.service.account.private.key", "spark.hadoop.fs.x.auth.pass", "spark.redis.auth",
    # Spark's own
    "spark.authenticate.secret", "spark.ssl.keyStorePassword", "spark.executorEnv.WANDB_API_KEY",
    # environment variables, as spark.executorEnv.* or in a tracker's settings
    "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AZURE_STORAGE_KEY", "DB_PASS", "DB_PWD",
    # an S3 request header (SSE-C)
    "x-amz-server-side-encryption-customer-key",
]
# Names of a class, a path, a mode or a count: masking one would drop it on --resume (a credential provider lost)
PLAIN_NAMES = [
    "fs.s3a.aws.credentials.provider", "fs.azure.sas.token.provider.type", "hadoop.security.credential.provider.path",
    "fs.s3a.delegation.token.binding", "fs.azure.account.auth.type", "fs.azure.account.oauth.provider.type",
    "spark.hadoop.google.cloud.auth.service.account.json.keyfile", "GOOGLE_APPLICATION_CREDENTIALS",
    "spark.authenticate.secret.file", "spark.kubernetes.authenticate.driver.oauthTokenFile",
    "spark.io.encryption.keySizeBits", "spark.authenticate", "spark.ssl.enabled", "fs.s3a.endpoint",
    "max_tokens", "num_tokens", "eos_token", "pad_token_id", "flops_per_token", "tokenizer.path", "spark.redaction.regex",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_a_secret_name_is_masked_in_files_and_lines(name):
    saved = redact.mapping({"spark": {"conf": {name: "Zq8-secret-of-" + name[-6:]}}})
    assert saved == {"spark": {"conf": {name: "***"}}}
    assert "Zq8" not in redact.text(f"--conf {name}=Zq8-other")


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_a_setting_that_names_no_secret_stays_readable_and_survives_a_resume(name):
    conf = {"spark": {"conf": {name: "org.example.Provider"}}}
    assert not redact.is_secret(name)
    assert redact.unmasked(redact.mapping(conf)) == conf


# -- credentials inside values ----------------------------------------------------------------------------

VALUES = [  # (as given, as saved and printed, the credential)
    ("abfss://:S3cr3tKey==@acct.dfs.core.windows.net/data", "abfss://***@acct.dfs.core.windows.net/data", "S3cr3tKey=="),
    ("s3a://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG@bucket/x", "s3a://***@bucket/x", "wJalrXUtnFEMI/K7MDENG"),
    ("https://alice:hunter2-pw@models.example.com/m", "https://***@models.example.com/m", "hunter2-pw"),
    ("https://acct.blob.core.windows.net/c/x.parquet?sv=2022-11-02&se=2030-01-01&sp=r&sig=AbC%2Bd3fG",
     "https://acct.blob.core.windows.net/c/x.parquet?sv=2022-11-02&se=2030-01-01&sp=r&sig=***", "AbC%2Bd3fG"),
    ("https://host/x?password=pw-in-query&user=me", "https://host/x?password=***&user=me", "pw-in-query"),
    ("https://login.example.com/t?client_id=app&client_secret=cs-in-query",
     "https://login.example.com/t?client_id=app&client_secret=***", "cs-in-query"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAXMPL%2F20240101"
     "&X-Amz-Signature=5d672d79c15b",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Signature=***",
     "5d672d79c15b"),
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=bXlrZXktdmFsdWU=;EndpointSuffix=core.windows.net",
     "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***;EndpointSuffix=core.windows.net",
     "bXlrZXktdmFsdWU="),
    ("Server=db;Database=x;Uid=me;Pwd=odbc-pw-9;", "Server=db;Database=x;Uid=me;Pwd=***;", "odbc-pw-9"),
    ("jdbc:postgresql://db/x?user=me&password=jdbc-pw-9", "jdbc:postgresql://db/x?user=me&password=***", "jdbc-pw-9"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.c2lnbmF0dXJl", "Authorization: Bearer ***",
     "eyJhbGciOiJIUzI1NiJ9.e30.c2lnbmF0dXJl"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic ***", "dXNlcjpwYXNzd29yZA=="),
]
PLAIN_VALUES = [
    "/data/train.parquet", "s3://bucket/key=value/part-0.parquet", "s3://bucket/year=2024/token=7/part-0.parquet",
    "hf://datasets/org/name", "HuggingFaceTB/SmolLM2-135M", "file:///x", "spark://host:7077", "local[*]",
    "abfss://container@acct.dfs.core.windows.net/dir",  # the container, not a user
    "https://host:8443/models/m@v2", "https://acct.blob.core.windows.net/c/x?sv=2022-11-02&se=2030-01-01",
    "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider", "a basic tokenizer",
]


@pytest.mark.parametrize("given,saved,secret", VALUES)
def test_a_credential_inside_a_value_is_masked_and_then_cleaned_from_later_lines(given, saved, secret):
    assert redact.value(given) == saved
    assert redact.mapping({"data": {"path": given}}) == {"data": {"path": saved}}
    assert redact.text(f"could not read {given}") == f"could not read {saved}"
    assert redact.text(f"the server said: {secret} is expired") == "the server said: *** is expired"


@pytest.mark.parametrize("given", PLAIN_VALUES)
def test_an_ordinary_value_is_kept_as_it_is(given):
    assert redact.value(given) == given
    assert redact.mapping({"tokenizer": {"path": given}}) == {"tokenizer": {"path": given}}


def test_a_bearer_header_masks_the_token_not_the_word():
    """The review: ``Authorization: Bearer X`` printed as ``Authorization: *** X``."""
    line = redact.text("request failed: Authorization: Bearer tok-live-8f2c91 was refused")
    assert "tok-live-8f2c91" not in line and "***" in line


def test_a_resumed_run_drops_a_spark_setting_whose_value_held_a_credential():
    saved = redact.mapping({"spark": {"conf": {"spark.hadoop.fs.defaultFS": "abfss://:KeyInFs==@a.dfs.core.windows.net",
                                               "fs.s3a.aws.credentials.provider": "org.example.Provider"}},
                            "model": {"init_from": "https://u:pw-in-uri@host/m"}})
    # a Spark setting goes like a secret key's; a sparklm field keeps its masked URI, whose use then fails naming it
    assert redact.unmasked(saved) == {"spark": {"conf": {"fs.s3a.aws.credentials.provider": "org.example.Provider"}},
                                      "model": {"init_from": "https://***@host/m"}}


# -- Spark masks the same -----------------------------------------------------------------------------------


def _java_finds(spark, pattern: str, s: str) -> bool:
    return spark.sparkContext._jvm.java.util.regex.Pattern.compile(pattern).matcher(s).find()


def _spark_redacts(spark, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Spark's own redaction of settings (what its environment page and event log show)."""
    jvm = spark.sparkContext._jvm
    listed = jvm.java.util.ArrayList()
    for k, v in pairs:
        listed.add(jvm.scala.Tuple2(k, v))
    seq = jvm.scala.jdk.javaapi.CollectionConverters.asScala(listed).toSeq()
    out = jvm.org.apache.spark.util.Utils.redact(spark.sparkContext._jsc.sc().conf(), seq)
    return [(t._1(), t._2()) for t in jvm.scala.jdk.javaapi.CollectionConverters.asJava(out)]


def test_sparks_ui_masks_what_sparklm_masks(spark):
    """The review: Spark's default regex shows ``fs.azure.account.key.*`` and ``spark.executorEnv.WANDB_API_KEY``."""
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.redaction.regex") == redaction_conf({})["spark.redaction.regex"]
    names = SECRET_NAMES + PLAIN_NAMES
    shown = dict(_spark_redacts(spark, [(n, "plain-value") for n in names]))
    assert [n for n in names if (shown[n] != "plain-value") != redact.is_secret(n)] == []
    assert shown["fs.azure.account.key.acct.dfs.core.windows.net"] == "*********(redacted)"
    assert shown["spark.executorEnv.WANDB_API_KEY"] == "*********(redacted)"
    # a value holding a credential is masked whatever its name (the environment page)
    shown = dict(_spark_redacts(spark, [(f"spark.hadoop.x{i}", g) for i, (g, _, _) in enumerate(VALUES)]
                                + [(f"spark.hadoop.y{i}", g) for i, g in enumerate(PLAIN_VALUES)]))
    assert {k for k, v in shown.items() if v == "*********(redacted)"} == {f"spark.hadoop.x{i}" for i in range(len(VALUES))}


def test_sparks_plans_mask_the_credentials_inside_values_as_sparklm_does(spark):
    jvm = spark.sparkContext._jvm
    pattern = spark._jsparkSession.sessionState().conf().stringRedactionPattern()  # spark.redaction.string.regex
    for given in [g for g, _, _ in VALUES] + PLAIN_VALUES:
        shown = jvm.org.apache.spark.util.Utils.redact(pattern, given).replace("*********(redacted)", "***")
        assert shown == redact.value(given)
    plan = spark.sql(f"select '{VALUES[1][0]}' as path")._jdf.queryExecution().toString()
    assert "wJalr" not in plan and "s3a://*********(redacted)@bucket/x" in plan


def test_a_users_own_redaction_regex_is_kept_and_sparklms_added(spark):
    mine = redaction_conf({"spark.redaction.regex": "(?i)mycorp", "spark.redaction.string.regex": "ticket-[0-9]+"})
    assert _java_finds(spark, mine["spark.redaction.regex"], "spark.mycorp.thing")
    assert _java_finds(spark, mine["spark.redaction.regex"], "fs.azure.account.key.a.dfs.core.windows.net")
    assert not _java_finds(spark, mine["spark.redaction.regex"], "fs.s3a.aws.credentials.provider")
    assert _java_finds(spark, mine["spark.redaction.string.regex"], "see ticket-42")
    assert _java_finds(spark, mine["spark.redaction.string.regex"], "https://x/y?sig=abc")
    assert redaction_conf(mine) == mine  # applied twice (a session started again): nothing doubles
