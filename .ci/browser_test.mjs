// Headless Chromium against the chat page: see browser.sh. usage: node browser_test.mjs URL OUTDIR
import { createRequire } from "node:module";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core");
const [url, out] = process.argv.slice(2);
const profile = mkdtempSync(join(tmpdir(), "gguftool-chromium-"));
const fail = (msg) => { console.error("FAIL browser: " + msg); process.exitCode = 1; };

// A fresh profile directory (Playwright passes it as --user-data-dir).
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1280, height: 900 },
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = browser.pages()[0] || await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  // Nothing but this server may be contacted: the page works offline.
  const foreign = [];
  page.on("request", (r) => { if (!r.url().startsWith(url)) foreign.push(r.url()); });
  await page.goto(url);
  await page.waitForFunction(() => !document.getElementById("model-name").textContent.includes("loading"));

  // Record every change of the answer's text, to see it arrive in pieces.
  await page.evaluate(() => {
    window.__seen = [];
    new MutationObserver(() => {
      const c = document.querySelector(".msg.assistant .content");
      if (c) window.__seen.push(c.textContent);
    }).observe(document.getElementById("messages"), { subtree: true, childList: true, characterData: true });
  });
  await page.fill("#prompt", "What is the capital of Japan?");
  await page.click("#send");
  await page.waitForFunction(
    () => (document.querySelector(".msg.assistant .content") || {}).textContent?.includes("Tokyo"),
    null, { timeout: 120000 });
  await page.waitForFunction(() => document.querySelector(".msg.assistant .meta").textContent.includes("finish"),
    null, { timeout: 120000 });
  const answer = await page.textContent(".msg.assistant .content");
  const seen = await page.evaluate(() => window.__seen);
  const distinct = new Set(seen).size;
  // Pieces the page parsed from the event stream (the text may be painted fewer times when
  // several arrive in one network read).
  const deltas = Number(await page.getAttribute(".msg.assistant", "data-deltas"));
  const tokens = await page.$$eval(".msg.assistant .tokens .token", (ts) =>
    ts.map((t) => ({ text: t.textContent, cls: t.className, title: t.title })));
  await page.screenshot({ path: join(out, "chat-page.png"), fullPage: true });
  console.log(`answer: ${JSON.stringify(answer)}; ${deltas} streamed pieces, ${distinct} distinct texts painted; ${tokens.length} tokens in the logprob view`);
  if (!answer.includes("Tokyo")) fail("no Tokyo in the answer");
  if (deltas < 3) fail(`the answer did not stream (${deltas} pieces)`);
  if (tokens.length < 3) fail("the log-probability view has no tokens");
  if (!tokens.every((t) => /token p(90|50|20|0)\b/.test(t.cls) && t.title.startsWith("p = "))) fail("tokens without a probability class");
  if (tokens.map((t) => t.text).join("") !== answer) fail("the token view does not spell the answer");

  await page.click("#tab-model");
  await page.waitForSelector("#model-info table");
  const info = await page.textContent("#model-info");
  await page.click("#run-verify");
  await page.waitForFunction(() => document.getElementById("verify-result").textContent.includes("tensors checked"),
    null, { timeout: 120000 });
  const verify = await page.textContent("#verify-result");
  await page.screenshot({ path: join(out, "model-page.png"), fullPage: true });
  for (const want of ["glm-dsa", "Quantization mix", "Q4_K", "Memory plan", "Tensor counts by role"]) {
    if (!info.includes(want)) fail(`model page lacks ${want}`);
  }
  if (!verify.includes("NaN values")) fail("no verify summary");
  if (errors.length) fail("page errors: " + errors.join("; "));
  if (foreign.length) fail("requests to other origins: " + foreign.join(", "));
  if (!process.exitCode) console.log(`PASS browser: Tokyo streamed in, ${tokens.length} coloured tokens, model page and verify; screenshots in ${out}`);
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
