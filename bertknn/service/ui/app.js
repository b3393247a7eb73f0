// The playground: a page over the public API (POST predict, POST follow), nothing else.
"use strict";

const $ = (id) => document.getElementById(id);
const FIELDS = ["text", "subject", "answer", "retriever", "lambda", "mlm_prior", "k", "temperature", "top_k", "relations", "beam"];
let mode = "predict";

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
const withMask = (text) => esc(text).replace(/\[mask\]/gi, (m) => `<span class="mask">${m}</span>`);
const marked = (sentence) => esc(sentence).replace(/\*\*(.+?)\*\*/g, "<mark>$1</mark>");
const fmt = (p) => (p >= 0.001 || p === 0 ? p.toFixed(4) : p.toExponential(2));

function setMode(m) {
  mode = m;
  for (const el of document.querySelectorAll(".predict-only")) el.hidden = m !== "predict";
  for (const el of document.querySelectorAll(".follow-only")) el.hidden = m !== "follow";
  for (const b of document.querySelectorAll(".mode")) {
    const on = b.id === `mode-${m}`;
    b.classList.toggle("active", on);
    b.setAttribute("aria-pressed", String(on));
  }
  $("text").required = m === "predict";
  $("go").textContent = m === "predict" ? "Ask" : "Follow";
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function requestBody() {
  const body = {};
  const subject = $("subject").value.trim();
  if (subject) body.subject = subject;
  if ($("retriever").value) body.retriever = $("retriever").value;
  for (const id of ["lambda", "k", "top_k"]) if (number(id) !== undefined) body[id] = number(id);
  const t = $("temperature").value.trim();
  if (t) body.temperature = t === "auto" ? "auto" : Number(t);
  if (mode === "predict") {
    body.text = $("text").value;
    if (number("mlm_prior") !== undefined) body.mlm_prior = number("mlm_prior");
    if ($("answer").value !== "word") body.answer = $("answer").value;
  } else {
    body.relations = $("relations").value.split("\n").map((r) => r.trim()).filter(Boolean);
    if (number("beam") !== undefined) body.beam = number("beam");
  }
  return body;
}

function saveToUrl() {
  const params = new URLSearchParams({ mode });
  for (const id of FIELDS) {
    const v = $(id).value.trim();
    if (v && !(id === "answer" && v === "word")) params.set(id, v);
  }
  history.replaceState(null, "", `${location.pathname}?${params}`);
}

function loadFromUrl() {
  const params = new URLSearchParams(location.search);
  setMode(params.get("mode") === "follow" ? "follow" : "predict");
  for (const id of FIELDS) if (params.has(id)) $(id).value = params.get(id);
  preview();
  return mode === "predict" ? params.has("text") : params.has("relations");
}

function preview() {
  $("preview").innerHTML = withMask($("text").value);
}

function showError(code, message) {
  const box = $("error");
  box.innerHTML = `<span class="code">${esc(code)}</span>: <span class="message">${esc(message)}</span>`;
  box.hidden = false;
  $("result").hidden = true;
}

async function ask() {
  saveToUrl();
  $("error").hidden = true;
  $("go").disabled = true;
  try {
    const r = await fetch(mode === "predict" ? "predict" : "follow", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(requestBody()),
    });
    const data = await r.json().catch(() => ({}));
    if (!r.ok) {
      const err = data.error || { code: String(r.status), message: r.statusText };
      showError(err.code, err.message);
      return;
    }
    $("result").innerHTML = mode === "predict" ? renderPredict(data) : renderFollow(data);
    $("result").hidden = false;
  } catch (e) {
    showError("network", String(e));
  } finally {
    $("go").disabled = false;
  }
}

function contextsList(contexts) {
  if (!contexts || !contexts.length) return "";
  const items = contexts.map(
    (c) => `<li><span class="sentence">${marked(c.sentence)}</span> <span class="article">${esc(c.article)}, d=${c.distance.toFixed(2)}, rank ${c.rank}</span></li>`
  );
  return `<ul class="contexts">${items.join("")}</ul>`;
}

function renderPredict(r) {
  const lam = r.lambda_used;
  const rows = r.predictions.map((p, i) => {
    const knn = lam * p.p_knn;
    const mlm = (1 - lam) * p.p_mlm;
    const entity = p.entity ? `<span class="entity">${esc(p.entity.title)}</span>` : "";
    return `<div class="answer" data-token="${esc(p.token)}" data-prob="${p.prob}" data-knn-share="${knn}" data-mlm-share="${mlm}">
      <div class="answer-head"><span class="rank">${i + 1}.</span><span class="token">${esc(p.token)}</span>${entity}<span class="prob">${fmt(p.prob)}</span></div>
      <div class="bar" title="kNN ${fmt(knn)} + MLM ${fmt(mlm)}"><span class="knn" style="width:${(100 * knn).toFixed(3)}%"></span><span class="mlm" style="width:${(100 * mlm).toFixed(3)}%"></span></div>
      <div class="split"><span class="k">λ·p_kNN ${fmt(knn)}</span> + <span class="m">(1−λ)·p_MLM ${fmt(mlm)}</span></div>
      ${contextsList(p.contexts)}
    </div>`;
  });
  const articles = r.articles.map(
    (a) => `<tr class="article-row"><td>${esc(a.title)}</td><td>${esc(a.rule)}</td><td>${a.score === null ? "" : a.score.toFixed(2)}</td></tr>`
  );
  const timings = Object.entries(r.timings_ms).map(([k, v]) => `${esc(k)} ${v.toFixed(1)} ms`).join(", ");
  const cache = Object.entries(r.cache).map(([k, v]) => `${esc(k)} ${esc(v)}`).join(", ");
  const warnings = r.warnings.length ? `<p class="warnings">${r.warnings.map(esc).join("<br>")}</p>` : "";
  return `${warnings}<div id="answers">${rows.join("") || "<p>No answer.</p>"}</div>
    <div class="meta">
      <p>λ used ${lam.toFixed(3)} (${esc(r.interpolation)}${r.knn_skipped ? ", kNN skipped" : ""}), temperature ${r.temperature_used.toFixed(2)}${r.subject_status ? `, subject ${esc(r.subject_status)}` : ""}</p>
      <table><thead><tr><th>article searched</th><th>found by</th><th>score</th></tr></thead><tbody>${articles.join("")}</tbody></table>
      <p>timings: ${timings}<br>cache: ${cache}<br>model ${esc(r.model.name)}, datastore ${esc(r.datastore.id)} v${r.datastore.version}</p>
    </div>`;
}

function renderFollow(r) {
  const answers = r.answers.map((a, i) => {
    const steps = a.path.map(
      (s, j) => `${j ? '<span class="arrow">→</span>' : ""}<span class="step" data-title="${esc(s.title)}">${esc(s.title)}${j ? ` <span class="prob">${fmt(s.prob)}</span>` : ""}${s.found_by ? ` <span class="found-by">${esc(s.found_by)}</span>` : ""}</span>`
    );
    const support = a.path.slice(1).map((s) => contextsList(s.contexts)).join("");
    return `<div class="answer follow-answer" data-title="${esc(a.title)}" data-prob="${a.prob}">
      <div class="answer-head"><span class="rank">${i + 1}.</span><span class="token">${esc(a.title)}</span><span class="prob">${fmt(a.prob)}</span></div>
      <div class="path">${steps.join("")}</div>${support}</div>`;
  });
  const warnings = r.warnings.length ? `<p class="warnings">${r.warnings.map(esc).join("<br>")}</p>` : "";
  const hops = r.hops.map((h, i) => `<li>hop ${i + 1} <code>${esc(h.relation)}</code>: ${h.entities.slice(0, 5).map((e) => `${esc(e.title)} ${fmt(e.prob)}`).join(", ")}</li>`);
  return `${warnings}<div id="answers">${answers.join("") || "<p>No answer.</p>"}</div>
    <div class="meta"><p>subject ${esc(r.subject)}</p><ul>${hops.join("")}</ul><p>total ${r.timings_ms.total.toFixed(1)} ms</p></div>`;
}

$("mode-predict").addEventListener("click", () => setMode("predict"));
$("mode-follow").addEventListener("click", () => setMode("follow"));
$("text").addEventListener("input", preview);
$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  ask();
});
if (loadFromUrl()) ask();
