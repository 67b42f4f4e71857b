"""Durable jobs and the staged version (kvfuse.store.jobs), on a real LMDB store (and the Redis index):
a staged version never disturbs the stored one, the swap is one transaction, an abandoned build leaves
nothing behind, `kvfuse store check` accepts staged refs, and flags blobs of another model."""

from __future__ import annotations

from store_kvdata import make_blob

from kvfuse.store import DocumentRecord, KVStore
from kvfuse.store.check import check_store
from kvfuse.store.jobs import JobRecord


def _doc(store: KVStore, doc_id: str, seeds: list[int], fingerprint: str = "test-model-fingerprint") -> list[str]:
    keys = []
    for s in seeds:
        key, blob, *_ = make_blob(s, fingerprint=fingerprint)
        store.put_chunk(key, blob)
        keys.append(key)
    return keys


def test_jobs_survive_a_reopen_and_purge_keeps_unfinished(store_settings) -> None:
    settings = store_settings()
    with KVStore.open(settings) as store:
        store.jobs.put_many([JobRecord(id="job-a", document_id="a", text="alpha"),
                             JobRecord(id="job-b", document_id="b", text="beta")])
        done = store.jobs.get("job-b")
        store.jobs.finish(done, "ready")
    with KVStore.open(settings) as store:
        assert [j.id for j in store.jobs.unfinished()] == ["job-a"]
        assert store.jobs.get("job-a").text == "alpha"
        assert store.jobs.get("job-b").status == "ready" and store.jobs.get("job-b").text == ""
        assert store.jobs.purge(0) == 1  # finished and older than 0 s: gone; the unfinished one stays
        assert store.jobs.get("job-b") is None and store.jobs.get("job-a") is not None


def test_staged_version_swaps_in_one_transaction(store_settings) -> None:
    with KVStore.open(store_settings(store={"orphan_grace_s": 0})) as store:
        v1 = _doc(store, "d", [1, 2])
        store.put_document(DocumentRecord(id="d", status="ready", chunk_keys=v1, chunk_tokens=[16, 16]), "v1")
        job = JobRecord(id="job-1", document_id="d", text="v2")
        store.jobs.put(job)
        v2_keys = [make_blob(s)[0] for s in (2, 3)]  # chunk 2 is shared by both versions
        store.jobs.stage(job, v2_keys)
        _doc(store, "d", [3])  # the worker writes the missing blob
        rep = check_store(store)
        assert rep.problems == 0, rep.to_dict()  # staged refs are expected; nothing is an orphan
        assert store.get_document("d").chunk_keys == v1 and store.get_text("d") == "v1"  # old answers
        store.jobs.commit(job, DocumentRecord(id="d", status="ready", chunk_keys=v2_keys,
                                              chunk_tokens=[16, 16]), "v2")
        assert store.get_document("d").chunk_keys == v2_keys and store.get_text("d") == "v2"
        assert store.jobs.get("job-1").status == "indexing"
        assert not store.has_chunk(v1[0]) and all(store.has_chunk(k) for k in v2_keys)
        assert check_store(store).problems == 0


def test_an_abandoned_build_leaves_the_old_version_and_no_orphans(store_settings) -> None:
    with KVStore.open(store_settings(store={"orphan_grace_s": 0})) as store:
        v1 = _doc(store, "d", [1, 2])
        store.put_document(DocumentRecord(id="d", status="ready", chunk_keys=v1, chunk_tokens=[16, 16]), "v1")
        job = JobRecord(id="job-1", document_id="d", text="v2")
        store.jobs.put(job)
        staged = [make_blob(s)[0] for s in (2, 4, 5)]
        store.jobs.stage(job, staged)
        _doc(store, "d", [4])  # the build died after one new blob
        store.jobs.abandon(job, "failed", "worker crashed")
        assert store.get_document("d").status == "ready" and store.get_document("d").chunk_keys == v1
        assert not store.has_chunk(staged[1]) and store.has_chunk(v1[1])
        assert store.jobs.get("job-1").status == "failed" and store.jobs.get("job-1").error == "worker crashed"
        assert check_store(store).problems == 0


def test_a_job_reads_as_ended_only_once_its_end_and_failed_document_are_stored(store_settings) -> None:
    """A status poll runs beside the end's write (the API reads the in-memory job): it must not see
    `failed` while the document's `failed` record is not yet there to read."""
    with KVStore.open(store_settings()) as store:
        job = JobRecord(id="job-1", document_id="new", text="t")
        store.jobs.put(job)
        seen: list[tuple[str, str | None]] = []
        write = store.catalog.put_document

        def watched(*args, **kwargs):  # the real write, with what a poll would read before and after it
            seen.append((job.status, getattr(store.get_document("new"), "status", None)))
            write(*args, **kwargs)
            seen.append((job.status, store.get_document("new").status))

        store.catalog.put_document = watched
        store.jobs.abandon(job, "failed", "why", DocumentRecord(id="new", status="failed", error="why"))
        assert seen == [("pending", None), ("pending", "failed")]
        assert job.status == "failed" and job.text == "" and store.jobs.get("job-1").status == "failed"


def test_check_reports_and_repairs_blobs_of_another_model(store_settings) -> None:
    with KVStore.open(store_settings(store={"orphan_grace_s": 0})) as store:
        old = _doc(store, "d", [1], fingerprint="old-model")
        store.put_document(DocumentRecord(id="d", status="ready", chunk_keys=old, chunk_tokens=[16]), "text")
        assert check_store(store).problems == 0  # no model recorded yet: nothing to compare with
        store.set_model_fingerprint("new-model")
        rep = check_store(store)
        assert rep.foreign == old and rep.problems == 1
        rep = check_store(store, repair=True)
        assert not store.has_chunk(old[0])
        rec = store.get_document("d")
        assert rec.status == "failed" and rec.error.startswith("kv_lost")  # the service rebuilds it at start
        assert check_store(store).problems == 0
