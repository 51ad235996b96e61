"""Questions that every node of the cluster (every worker of ``--workers N``) answers: what the
administrative endpoints need to speak for the whole server, wherever a tenant's connections
and sessions are (:mod:`seedance.server.admin`).

A question (its kind, its body and a reply key) is published on the channel ``sd:ask``;
``PUBLISH`` says how many nodes listen, and each pushes its answer onto the reply key, which
the asker pops until it has them all or :data:`TIMEOUT_S` passed. A node that does not answer
in time is left out (and logged).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from redis.exceptions import RedisError

from seedance.cluster.link import PREFIX, ClusterLink

logger = logging.getLogger(__name__)

CHANNEL: Final = PREFIX + "ask"
#: The longest a question waits for the nodes' answers.
TIMEOUT_S: Final = 2.0

#: What a node does with a question's body; its answer (anything JSON holds).
Answerer = Callable[[Any], Awaitable[Any]]


class _Question(msgspec.Struct, array_like=True):
    kind: str
    body: Any
    reply: str


class Asks:
    """Asks the nodes questions, and answers theirs with :attr:`answerers`."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        #: What this node answers, by the question's kind (set by the server).
        self.answerers: dict[str, Answerer] = {}

    def start(self) -> None:
        self.link.listen(CHANNEL, self._received)

    async def ask(self, kind: str, body: Any = None) -> list[Any]:
        """Every node's answer (this node's too; one that did not answer in time is left out,
        and logged); ``overloaded`` while Redis does not answer."""
        self.link.check()
        reply = f"{PREFIX}answers:{secrets.token_hex(8)}"
        question = msgspec.json.encode(_Question(kind, body, reply))
        (asked,) = await self.link.exchange(lambda pipe: pipe.publish(CHANNEL, question))
        answers: list[Any] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT_S
        try:
            while len(answers) < asked and (left := deadline - loop.time()) > 0:
                popped = await self.link.blocking.blpop([reply], timeout=left)
                if popped is None:
                    break
                answers.append(msgspec.json.decode(popped[1]))
        except (RedisError, OSError) as exc:
            logger.warning("cluster: the answers to %s were not all read: %s", kind, exc)
        finally:
            self.link.spawn(self._forget(reply), "cluster-answers-read")
        if len(answers) < asked:
            logger.warning(
                "cluster: %d of %d node(s) answered %s within %.0f s",
                len(answers),
                asked,
                kind,
                TIMEOUT_S,
            )
        return answers

    def _received(self, data: bytes) -> None:
        try:
            question = msgspec.json.decode(data, type=_Question)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("cluster: a question that does not parse: %r", data[:200])
            return
        answerer = self.answerers.get(question.kind)
        if answerer is None:  # a newer node's question
            logger.warning("cluster: a question this node does not know: %s", question.kind)
            return
        self.link.spawn(self._answer(answerer, question), "cluster-answer")

    async def _answer(self, answerer: Answerer, question: _Question) -> None:
        try:
            answer = msgspec.json.encode(await answerer(question.body))
        except Exception:
            logger.exception("cluster: %s not answered", question.kind)
            return
        lasts_ms = int(TIMEOUT_S * 2000)  # gone if the asker is

        def queue(pipe: Any) -> None:
            pipe.rpush(question.reply, answer)
            pipe.pexpire(question.reply, lasts_ms)

        try:
            await self.link.exchange(queue)
        except Exception as exc:  # Redis down: the asker leaves this node out
            logger.debug("cluster: %s answered but not sent: %s", question.kind, exc)

    async def _forget(self, reply: str) -> None:
        try:
            await self.link.exchange(lambda pipe: pipe.delete(reply))
        except Exception as exc:  # it expires anyway
            logger.debug("cluster: %s not deleted: %s", reply, exc)
